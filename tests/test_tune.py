"""`tfm tune`: trials of `tfm train` runs chosen by Optuna, pruned, resumed and shared between processes."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from conftest import CONFIGS, REPO, tiny_config
from typer.testing import CliRunner

from transformer_cli import tune
from transformer_cli.cli import app
from transformer_cli.config import load_config
from transformer_cli.evaluate import predict_texts

runner = CliRunner()

SPACE = """
["train.lr"]
low = 1e-3
high = 1e-2
log = true

[model.dropout]  # a dotted table name, unquoted, is the same field
choices = [0.0, 0.1]
"""
# tiny.toml on the synthetic data, short: validations at steps 4, 8 and 12
SETTINGS = ["train.device=cpu", "train.precision=fp32", "train.max_steps=12", "train.eval_every=4"]


@pytest.fixture
def space(tmp_path) -> Path:
    path = tmp_path / "space.toml"
    path.write_text(SPACE)
    return path


def tfm_tune(data_dir, space, study, *args):
    return runner.invoke(app, ["tune", "--config", str(CONFIGS / "tiny.toml"), "--data", str(data_dir), "--space",
                               str(space), "-o", str(study), *map(str, args), *SETTINGS])


def load_study(study: Path) -> optuna.Study:
    return optuna.load_study(study_name=study.name, storage=f"sqlite:///{study / 'study.db'}")


def states(study: Path) -> dict[int, str]:
    return {t.number: t.state.name for t in load_study(study).trials}


def tune_command(data_dir, space, study, *args) -> list[str]:
    return [sys.executable, "-m", "transformer_cli", "tune", "--config", str(CONFIGS / "tiny.toml"), "--data",
            str(data_dir), "--space", str(space), "-o", str(study), *args, *SETTINGS]


@pytest.fixture(scope="module")
def study(synthetic_data_dir, tmp_path_factory):
    """A finished study of three trials; tests only read it."""
    root = tmp_path_factory.mktemp("tune")
    (root / "space.toml").write_text(SPACE)
    r = tfm_tune(synthetic_data_dir, root / "space.toml", root / "study", "--trials", 3)
    assert r.exit_code == 0, r.stderr
    return root / "study", root / "space.toml", r


def test_a_study_runs_its_trials_and_writes_the_best_settings_as_a_recipe(study, synthetic_data_dir):
    path, _, r = study
    assert states(path) == {0: "COMPLETE", 1: "COMPLETE", 2: "COMPLETE"}
    best = load_study(path).best_trial
    assert sorted(p.name for p in (path / "trials").iterdir()) == ["0000", "0001", "0002"]
    for trial in (path / "trials").iterdir():  # each an ordinary `tfm train` run
        assert {"metrics.json", "model.safetensors", "config.json"} <= {p.name for p in trial.iterdir()}
        assert list(trial.glob("events.out.tfevents.*"))
    cfg = load_config(path / "best.toml")
    assert cfg.train.lr == best.params["train.lr"] and cfg.model.dropout == best.params["model.dropout"]
    assert cfg.train.max_steps == 12 and cfg.model.d_model == 32  # the base config's, under the best values
    assert cfg.data.source == str(synthetic_data_dir) and not cfg.train.test_at_end
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["trial", "state", "train.lr", "model.dropout", "val", "accuracy", "steps", "time",
                                "note"]
    assert [line.split()[:2] for line in lines[1:4]] == [["0", "COMPLETE"], ["1", "COMPLETE"], ["2", "COMPLETE"]]
    assert f"best: trial {best.number}, val accuracy {best.value:.4f}: {path / 'trials' / f'{best.number:04d}'}" \
        in r.stdout
    assert len(predict_texts(path / "trials" / f"{best.number:04d}", ["great wonderful film"], "cpu")) == 1


def test_a_study_that_holds_trials_continues_only_with_resume_and_its_own_settings(study, synthetic_data_dir,
                                                                                   tmp_path):
    path, space, _ = study
    r = tfm_tune(synthetic_data_dir, space, path, "--trials", 3)
    assert r.exit_code == 2 and "already holds 3 trials; pass --resume" in r.stderr
    other = tmp_path / "other.toml"
    other.write_text(SPACE.replace("1e-2", "2e-2"))
    r = tfm_tune(synthetic_data_dir, other, path, "--trials", 3, "--resume")
    assert r.exit_code == 2 and "was started with other settings (train.lr" in r.stderr
    r = tfm_tune(synthetic_data_dir, space, path, "--trials", 3, "--resume")  # it has its trials: nothing to run
    assert r.exit_code == 0 and len(load_study(path).trials) == 3 and "best: trial" in r.stdout


class PruneAtOnce(optuna.pruners.BasePruner):
    def prune(self, study, trial) -> bool:
        return True  # asked after each report: the first one prunes


def test_a_pruned_trial_stops_at_its_first_validation_and_its_directory_loads(synthetic_data_dir, space, tmp_path):
    cfg = tiny_config(synthetic_data_dir, tmp_path / "unused", train__max_steps=12, train__eval_every=4)
    out = tune.tune(cfg, space, 2, tmp_path / "study", pruner=PruneAtOnce())
    trials = out.study.trials
    assert [t.state.name for t in trials] == ["PRUNED", "PRUNED"]
    assert [t.user_attrs["steps"] for t in trials] == [4, 4]
    assert [list(t.intermediate_values) for t in trials] == [[4], [4]]
    assert out.best_dir is None and not (tmp_path / "study" / "best.toml").exists()  # no trial finished
    trial = tmp_path / "study" / "trials" / "0000"
    assert not (trial / "metrics.json").exists()
    assert len(predict_texts(trial, ["great wonderful film"], "cpu")) == 1


@pytest.mark.parametrize("space_text, args, fragment", [
    ('["train.lrr"]\nlow = 1e-4\nhigh = 1e-2', [], "unknown config field 'train.lrr'"),
    ('["optim.lr"]\nlow = 1e-4\nhigh = 1e-2', [], "unknown config section 'optim'"),
    ('["pretrain.mask_prob"]\nchoices = [0.1]', [], "unknown config section 'pretrain'"),
    ('["model.pooling"]\nlow = 0\nhigh = 1', [], "model.pooling is not a number; give its choices"),
    ('["model.dropout"]\nchoices = [0.1, 1.5]', [], "choice 1.5 is refused: model.dropout = 1.5: must be in [0, 1)"),
    ('["model.dropout"]\nlow = 0.0\nhigh = 1.0', [], "high 1.0 is refused: model.dropout = 1.0"),
    ('["train.lr"]\nlow = 1e-2\nhigh = 1e-4', [], "low = 0.01 is above high = 0.0001"),
    ('["train.lr"]\nlow = 1e-4\nhigh = 1e-2\nlgo = true', [], "unknown key 'lgo' in [\"train.lr\"]; valid keys"),
    ('["train.batch_size"]\nlow = 8.5\nhigh = 32', [], "low = 8.5: train.batch_size takes an integer"),
    ('["train.output_dir"]\nchoices = ["a"]', [], "train.output_dir is not searched"),
    ('"train.lr" = 1e-3', [], "is no search range"),
    ("", [], "names no field to search"),
    ('["train.lr"]\nlow = 1e-4\nhigh = 1e-2', ["--trials", "0"], "Invalid value for '--trials'"),
    ('["train.lr"]\nlow = 1e-4\nhigh = 1e-2', ["--trials", "2", "--timeout", "soon"], "--timeout 'soon'"),
])
def test_bad_input_exits_2_before_any_trial(synthetic_data_dir, tmp_path, space_text, args, fragment):
    space = tmp_path / "space.toml"
    space.write_text(space_text)
    r = tfm_tune(synthetic_data_dir, space, tmp_path / "study", *(args or ["--trials", "2"]))
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("tfm: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert fragment in r.stderr
    assert not (tmp_path / "study").exists()


def test_a_storage_that_cannot_be_opened_exits_1(synthetic_data_dir, space, tmp_path):
    (tmp_path / "a-file").write_text("")
    r = tfm_tune(synthetic_data_dir, space, tmp_path / "study", "--trials", 2, "--storage",
                 f"sqlite:///{tmp_path / 'a-file' / 'study.db'}")
    assert r.exit_code == 1 and r.stderr.startswith("tfm: error: cannot open the study's storage"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "study" / "trials").exists()


@pytest.mark.slow
def test_resume_after_kill_9_ends_with_exactly_the_trials_asked_for(synthetic_data_dir, space, tmp_path):
    study = tmp_path / "study"
    first = subprocess.Popen(tune_command(synthetic_data_dir, space, study, "--trials", "3"), cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (study / "trials" / "0000").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the study ended before it could be killed"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert states(study) == {0: "RUNNING"}
    r = subprocess.run(tune_command(synthetic_data_dir, space, study, "--trials", "3", "--resume"), check=False,
                       cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    trials = load_study(study).trials
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE", "COMPLETE"]
    assert trials[1].user_attrs["retry_of"] == 0 and trials[1].params == trials[0].params
    assert len({t.number for t in trials}) == len(trials)
    row = next(line for line in r.stdout.splitlines() if line.startswith("0 "))
    assert "its process died; retried as 1" in row
    for t in trials[1:]:
        predict_texts(study / "trials" / f"{t.number:04d}", ["great"], "cpu")


@pytest.mark.slow
def test_two_processes_share_one_study(synthetic_data_dir, space, tmp_path):
    study = tmp_path / "study"
    command = tune_command(synthetic_data_dir, space, study, "--trials", "4")
    first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (study / "trials" / "0000").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    second = subprocess.Popen([*command, "--resume"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    errors = [p.communicate(timeout=300)[1] for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, errors
    trials = load_study(study).trials
    finished = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(finished) == 4 and {t.user_attrs["pid"] for t in finished} == {first.pid, second.pid}
    # a trial asked for while the other process took the last one is told so, and never run
    assert all(t.user_attrs["error"].startswith("not run") for t in trials if t.state.name != "COMPLETE")
    assert sorted(p.name for p in (study / "trials").iterdir()) == [f"{t.number:04d}" for t in finished]
