"""Crash-safe files: atomic writes, the model directory, and resumable training checkpoints.

Every file is written to a temporary name in the same folder, flushed, fsynced and renamed, so a
reader sees the old file or the new one, never half of one. A training checkpoint is a folder
`checkpoints/step-NNNNNNNN/` that counts only once its `COMPLETE` marker exists. Nothing here
unpickles: weights are safetensors, metadata JSON, optimizer state `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from transformer_cli.errors import TfmError, first_line

MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE, METRICS_FILE = "model.safetensors", "config.json", "tokenizer.json", "metrics.json"
FORMAT_VERSION = 1
CKPT_DIR, COMPLETE = "checkpoints", "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


TEMP_FILE = re.compile(r"\..+\.tmp-[0-9]+")  # the names atomic_write_bytes writes to: .NAME.tmp-PID


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def remove_stale_temp_files(folder: Path) -> None:
    """Delete the temp files that killed `atomic_write_bytes` calls left in `folder` (nothing else)."""
    for path in folder.glob(".*.tmp-*"):
        if TEMP_FILE.fullmatch(path.name) and path.is_file():
            with contextlib.suppress(OSError):
                path.unlink()


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TfmError(f"{what} '{path}' is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TfmError(f"{what} '{path}' is unreadable ({e}); re-run training to recreate it") from None


# --------------------------------------------------------------------------- weights


def state_bytes(model) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()})


def load_weights(model, path: Path) -> None:
    """Load safetensors weights into `model`, refusing any name or shape mismatch."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise TfmError(f"weights file '{path}' is missing") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise TfmError(f"weights file '{path}' is damaged or not safetensors ({e})") from None
    expected = model.state_dict()
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
    model.load_state_dict(tensors)


# --------------------------------------------------------------------------- the model directory


def save_model_files(out: Path, cfg_dict: dict, tokenizer_json: str, labels: list[str], vocab_size: int) -> None:
    """config.json and tokenizer.json: everything predict needs besides the weights."""
    write_json(out / CONFIG_FILE, {
        "format_version": FORMAT_VERSION,
        "labels": labels,
        "vocab_size": vocab_size,
        **cfg_dict,
    })
    atomic_write_text(out / TOKENIZER_FILE, tokenizer_json)


def load_model_dir(path: str | Path, device="cpu"):
    """(model in eval mode, Config, tokenizer, labels) from a `tfm train` output directory."""
    from tokenizers import Tokenizer

    from transformer_cli.config import Config, with_legacy_values
    from transformer_cli.model import CTransformer

    out = Path(path)
    if not out.is_dir():
        what = "is a file, not a directory" if out.exists() else "does not exist"
        raise TfmError(f"checkpoint directory '{out}' {what}; pass the --output-dir of a `tfm train` run")
    for name in (CONFIG_FILE, TOKENIZER_FILE, MODEL_FILE):
        if not (out / name).is_file():
            raise TfmError(f"'{out}' is not a complete model directory: {name} is missing")
    meta = read_json(out / CONFIG_FILE, "config")
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise TfmError(f"'{out / CONFIG_FILE}' has format version {version!r}; this tfm reads version {FORMAT_VERSION}")
    try:
        cfg = Config.from_dict(with_legacy_values({k: meta[k] for k in ("model", "data", "train")}))
        labels, vocab_size = meta["labels"], int(meta["vocab_size"])
        if not (isinstance(labels, list) and len(labels) >= 2 and all(isinstance(x, str) for x in labels)
                and len(set(labels)) == len(labels)):
            raise ValueError(f"labels must be a list of at least two distinct names, not {labels!r}")
    except (KeyError, TypeError, ValueError, TfmError) as e:  # TfmError: a value the config refuses
        raise TfmError(f"'{out / CONFIG_FILE}' is incomplete or invalid ({e})") from None
    try:
        tokenizer = Tokenizer.from_file(str(out / TOKENIZER_FILE))
    except Exception as e:
        raise TfmError(f"tokenizer '{out / TOKENIZER_FILE}' is unreadable ({e})") from None
    if tokenizer.get_vocab_size() != vocab_size:
        raise TfmError(f"tokenizer in '{out}' has {tokenizer.get_vocab_size()} tokens but config.json says {vocab_size}")
    model = CTransformer(cfg.model, vocab_size, cfg.data.max_length, len(labels))
    load_weights(model, out / MODEL_FILE)
    # aminmax carries a NaN or inf through to its result: 2 ms for the default model, isfinite().all() 35.
    bad = [name for name, t in model.state_dict().items()
           if t.is_floating_point() and not all(v.isfinite() for v in t.aminmax())]
    if bad:
        raise TfmError(f"weights in '{out / MODEL_FILE}' are not finite (NaN or inf in {', '.join(bad[:3])}); "
                       "the file is damaged or the run diverged: train again")
    return model.to(device).eval(), cfg, tokenizer, labels


# --------------------------------------------------------------------------- training checkpoints


def checkpoint_dirs(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(out) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def save_checkpoint(out: Path, step: int, model, train_state: dict, tensors_state: dict, keep: int) -> Path:
    """Write checkpoints/step-N atomically (temp folder, fsync, marker, rename); prune to `keep`."""
    import torch

    root = Path(out) / CKPT_DIR
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        atomic_write_bytes(tmp / MODEL_FILE, state_bytes(model))
        import io

        buf = io.BytesIO()
        torch.save(tensors_state, buf)
        atomic_write_bytes(tmp / "state.pt", buf.getvalue())
        write_json(tmp / "trainer.json", train_state)
        atomic_write_text(tmp / COMPLETE, f"{step}\n")
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(root)
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
    import pickle

    import torch

    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise TfmError(f"'{path}' is not a complete checkpoint (no {COMPLETE} marker); pick another one")
    train_state = read_json(path / "trainer.json", "checkpoint state")
    try:
        tensors_state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as e:
        raise TfmError(f"refusing to load '{path / 'state.pt'}': {first_line(e)}") from None
    return train_state, tensors_state
