import errno
import os
from pathlib import Path

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
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left on device") as e:
        fileio.atomic_write_bytes(path, b"new")
    assert e.value.filename == str(path)  # the file asked for, not its temporary name
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_check_output_path_names_the_path_as_given(tmp_path, monkeypatch):
    from transformer_cli.errors import UsageError

    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("x")
    Path("adir").mkdir()
    assert fileio.check_output_path("adir/new/page.html", "--html") == Path("adir/new/page.html")
    assert fileio.check_output_path("adir", "--report", folder=True) == Path("adir")
    with pytest.raises(UsageError, match=r"^--html 'afile/sub/x\.html' cannot be created \('afile' is a file, not a "
                                         r"folder\); choose another --html$"):
        fileio.check_output_path("afile/sub/x.html", "--html")
    with pytest.raises(UsageError, match="^--report 'afile' is a file; pass a folder$"):
        fileio.check_output_path("afile", "--report", folder=True, hint="pass a folder")
    with pytest.raises(UsageError, match="^--html 'adir' is a directory"):
        fileio.check_output_path("adir", "--html")
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != Path("adir") and access(p, mode))  # as if chmod 555
    with pytest.raises(UsageError, match=r"^--html 'adir/new/x\.html' cannot be written \('adir' is not writable\)"):
        fileio.check_output_path("adir/new/x.html", "--html")
    with pytest.raises(UsageError, match=r"'adir' cannot be written \('adir' is not writable\)"):
        fileio.check_output_path("adir", "--report", folder=True)
    assert sorted(os.listdir()) == ["adir", "afile"] and os.listdir("adir") == []


@pytest.mark.parametrize("failing", ["a.onnx", "a.tokenizer.json"])
def test_files_written_together_are_all_replaced_or_none(tmp_path, monkeypatch, failing):
    files = {tmp_path / "a.tokenizer.json": b"new tokenizer", tmp_path / "a.onnx": b"new graph"}
    for path in files:
        path.write_bytes(b"old")
    fsync = os.fsync

    def disk_full_on(fd):  # the write of `failing` fails once its bytes are handed over
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f".{failing}.tmp-{os.getpid()}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(fileio.os, "fsync", disk_full_on)
    with pytest.raises(OSError, match="No space left on device") as e:
        fileio.atomic_write_together(files)
    assert e.value.filename == str(tmp_path / failing)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {"a.tokenizer.json": b"old", "a.onnx": b"old"}
    monkeypatch.setattr(fileio.os, "fsync", fsync)
    fileio.atomic_write_together(files)
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_a_failed_write_names_the_file_asked_for_not_its_temp_name(tmp_path, monkeypatch):
    def refused(name, mode="r", *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(name))

    monkeypatch.setattr(fileio, "open", refused, raising=False)  # where the temp file is opened
    path = tmp_path / "page.html"
    for write in (lambda: fileio.atomic_write_bytes(path, b"x"), lambda: fileio.atomic_write_together({path: b"x"})):
        with pytest.raises(PermissionError) as failed:
            write()
        assert failed.value.filename == str(path)
        assert str(path) in str(failed.value)
    assert list(tmp_path.iterdir()) == []
