import os

import pytest

from transformer_cli import fileio


def test_atomic_write_creates_replaces_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "sub" / "f.bin"
    fileio.atomic_write_bytes(path, b"first")
    fileio.atomic_write_bytes(path, b"second")
    assert path.read_bytes() == b"second"
    assert os.listdir(path.parent) == ["f.bin"]


def test_failed_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    fileio.atomic_write_bytes(path, b"old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        fileio.atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]
