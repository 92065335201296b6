"""Crash-safe files (atomic writes, JSON) and the cache folder.

Every file is written to a temporary name in the same folder, flushed, fsynced and renamed, so a
reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from transformer_cli.errors import TfmError, UsageError

TEMP_FILE = re.compile(r"\..+\.tmp-[0-9]+")  # the names atomic_write_bytes writes to: .NAME.tmp-PID


def fsync_dir(path: Path) -> None:
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


def check_output_path(path: str | Path, name: str, folder: bool = False, hint: str | None = None,
                      inputs: Iterable[str | Path] = ()) -> Path:
    """`path` if a command can write it, else a UsageError naming it as given (`name`: the option, e.g.
    '--html'; `hint`: what to do, default 'choose another NAME'): checked before the work, which would
    otherwise fail only at its end. A file's path must not be a folder, a folder's not a file, no folder
    above it a file, the nearest existing folder (the file's own place, for a file) must be writable,
    and it must not be one of the command's `inputs` (by any name: links count)."""
    path = Path(path)
    hint = hint or f"choose another {name}"
    if path.exists():
        for f in inputs:
            if Path(f).exists() and os.path.samefile(path, f):
                raise UsageError(f"{name} '{path}' is the command's input '{f}'; write to another file")
    if folder and path.exists() and not path.is_dir():
        raise UsageError(f"{name} '{path}' is a file; {hint}")
    if not folder and path.is_dir():
        raise UsageError(f"{name} '{path}' is a directory; {hint}")
    existing = next((p for p in ((path,) if folder else ()) + tuple(path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UsageError(f"{name} '{path}' cannot be created ('{existing}' is a file, not a folder); {hint}")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{name} '{path}' cannot be written ('{existing}' is not writable); {hint}")
    return path


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write `path` through, in parts: it appears at `path` whole when the block ends,
    and not at all if the block raises (the file there before, if any, stays)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        _name_the_file(e, tmp, path)
        raise
    fsync_dir(path.parent)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _name_the_file(e: BaseException, tmp: Path, path: Path) -> None:
    """An OSError about temp file `tmp`, or about no file (a failed write), made to name `path`, the file the user
    asked for."""
    if isinstance(e, OSError) and (e.filename == str(tmp) or e.filename is None and e.errno is not None):
        e.filename = str(path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def atomic_write_together(files: dict[Path, bytes]) -> None:
    """Files that belong together (an exported graph and its tokenizer): every one written and fsynced
    under its temporary name before any is renamed, so a failed write replaces none of them."""
    temps: list[tuple[Path, Path]] = []
    try:
        for path, data in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            temps.append((_temp_name(path), path))
            with open(temps[-1][0], "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for tmp, path in temps:
            os.replace(tmp, path)
    except BaseException as e:
        for tmp, path in reversed(temps):  # the file being written when a write failed is the last one begun
            tmp.unlink(missing_ok=True)
            _name_the_file(e, tmp, path)
        raise
    for folder in {path.parent for path in files}:
        fsync_dir(folder)


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


def cache_dir() -> Path:
    """Where caches go: $TFM_CACHE, else ~/.cache/transformer_cli."""
    return Path(os.environ.get("TFM_CACHE") or Path.home() / ".cache" / "transformer_cli").expanduser()


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TfmError(f"{what} '{path}' is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TfmError(f"{what} '{path}' is unreadable ({e}); re-run training to recreate it") from None
