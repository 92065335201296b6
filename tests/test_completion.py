"""Shell completion: typer's --show-completion / --install-completion, and the completion requests the
installed script makes, answered by `tfm` without importing torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run_tfm(*args: str, env: dict | None = None, code: str = "",
            under_bash: bool = False) -> subprocess.CompletedProcess:
    """`tfm ARGS` in a fresh Python (as the console script runs it); `code` runs at its exit. `under_bash`:
    as a child of bash, since typer finds the user's shell among the process's ancestors (shellingham),
    which a test runner need not have."""
    program = ("import atexit, sys\n" + (f"atexit.register(lambda: {code})\n" if code else "")
               + "from transformer_cli.cli import main\nsys.argv[0] = 'tfm'\nmain()\n")
    cmd = [sys.executable, "-c", program, *args]
    if under_bash:
        cmd = ["bash", "-c", '"$@"; exit $?', "bash", *cmd]  # not exec'd: bash stays the parent
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          timeout=120, env={**os.environ, **(env or {})}, check=False)


@needs_bash
def test_show_completion_prints_a_bash_script():
    r = run_tfm("--show-completion", env={"SHELL": "/bin/bash"}, under_bash=True)
    assert r.returncode == 0, r.stderr
    assert "_tfm_completion()" in r.stdout and "_TFM_COMPLETE=complete_bash" in r.stdout
    assert "complete -o default -F _tfm_completion tfm" in r.stdout


@pytest.mark.parametrize(("words", "cword", "want"), [
    ("tfm tr", 1, ["train"]),
    ("tfm ", 1, ["train", "pretrain", "tune", "data", "predict", "evaluate"]),
    ("tfm evaluate --js", 2, ["--json"]),
    ("tfm train --resume-f", 2, ["--resume-from"]),
])
def test_completion_requests_are_answered_without_importing_torch(words, cword, want):
    env = {"_TFM_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    r = run_tfm(env=env, code="print('torch imported' if 'torch' in sys.modules else '', file=sys.stderr)")
    assert r.returncode == 0, r.stderr
    assert set(want) <= set(r.stdout.split()) and r.stdout.split()[: len(want)] == want
    assert "torch imported" not in r.stderr


@needs_bash
def test_install_completion_installs_a_script_that_completes(tmp_path):
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    shim = bin_dir / "tfm"  # `tfm` on PATH, as the package's console script would be
    shim.write_text(f"#!/bin/sh\nexec '{sys.executable}' -m transformer_cli \"$@\"\n")
    shim.chmod(0o755)
    env = {"HOME": str(home), "SHELL": "/bin/bash", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    r = run_tfm("--install-completion", env=env, under_bash=True)
    assert r.returncode == 0, r.stderr
    script = home / ".bash_completions" / "tfm.sh"
    assert "bash completion installed in" in r.stdout and script.is_file()
    assert f"source '{script}'" in (home / ".bashrc").read_text()
    completed = subprocess.run(
        ["bash", "-c", (f"source '{script}'; COMP_WORDS=(tfm pre); COMP_CWORD=1; _tfm_completion tfm; "
                        'printf "%s\\n" "${COMPREPLY[@]}"')],  # bash passes the command's name
        capture_output=True, text=True, env={**os.environ, **env}, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["pretrain", "predict"]  # in the order of the commands


def test_help_lists_the_completion_options_and_imports_no_torch():
    r = run_tfm("--help", code="print('torch imported' if 'torch' in sys.modules else '', file=sys.stderr)")
    assert r.returncode == 0 and "--install-completion" in r.stdout and "--show-completion" in r.stdout
    assert "torch imported" not in r.stderr


def test_the_error_boundary_still_holds_with_completion_on():
    r = run_tfm("--no-such-option")
    assert r.returncode == 2 and r.stderr.startswith("tfm: error: No such option: --no-such-option")
    assert not Path(REPO, ".bash_completions").exists()
