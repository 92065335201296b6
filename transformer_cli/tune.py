"""`tfm tune`: a hyperparameter search over `tfm train` runs, handed to Optuna.

The search space is a TOML file, one table per config field named by its dotted name, with a range or choices;
every value it allows at its ends is checked by the config's own validation before any trial runs. Each trial
is an ordinary `tfm train` run, STUDY_DIR/trials/NNNN, that reports each validation pass to Optuna, whose pruner
(the median rule by default) stops poor trials early. The study lives in a database (SQLite in STUDY_DIR by
default, or any storage URL Optuna takes), so that a search that was killed continues with --resume, and
several processes may share it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from transformer_cli.config import SECTIONS, Config, duration_sec, load_config, read_toml
from transformer_cli.errors import TfmError, UsageError, cause_line, first_line
from transformer_cli.fileio import atomic_write_text, check_output_path

STUDY_FILE, BEST_FILE, TRIALS_DIR = "study.db", "best.toml", "trials"
RANGE_KEYS, CHOICE_KEYS = {"low", "high", "log", "step"}, {"choices"}
SEARCHABLE = ("model", "data", "train")  # the sections `tfm train` reads
SET_BY_TUNE = {
    "train.output_dir": "each trial trains into STUDY_DIR/trials/NNNN",
    "train.test_at_end": "trials never read the test split",
    "train.select_metric": "it is the study's objective; set it in the base config",
}
MAX_FAILED_IN_ROW = 5  # trials of this process that failed one after another before it gives up
HOST = socket.gethostname()
SETTINGS_ATTR = "tfm"  # the study's user attribute holding the base config and the space it was started with


# --------------------------------------------------------------------------- the search space


@dataclass(frozen=True)
class Param:
    """One field's range (low..high, maybe on a log scale or in steps) or choices."""

    name: str  # SECTION.FIELD
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple | None = None
    integer: bool = False

    def suggest(self, trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.integer:
            return trial.suggest_int(self.name, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def to_dict(self) -> dict:
        if self.choices is not None:
            return {"choices": list(self.choices)}
        return {"low": self.low, "high": self.high, "log": self.log, "step": self.step}


def read_space(path: str | Path, base: dict) -> list[Param]:
    """The parameters of a space file, each value it allows at its ends (or each choice) checked as a
    setting of `base` (a Config's dict) by load_config; anything wrong is a UsageError naming the file."""
    where = f"--space '{path}'"
    raw = read_toml(path, where)
    params: dict[str, Param] = {}
    for name, spec in _tables(raw):
        if name in params:
            raise UsageError(f"{where}: {name} is given twice")
        params[name] = _param(where, name, spec, base)
    if not params:
        raise UsageError(f'{where} names no field to search; add a table such as ["train.lr"] with low and high')
    return list(params.values())


def _tables(d: dict, prefix: str = ""):
    """(dotted name, table) of each search table: ["train.lr"] and [train.lr] alike."""
    for key, value in d.items():
        name = prefix + key
        if isinstance(value, dict) and value and not value.keys() & (RANGE_KEYS | CHOICE_KEYS) \
                and all(isinstance(v, dict) for v in value.values()):
            yield from _tables(value, name + ".")
        else:
            yield name, value


def _param(where: str, name: str, spec: Any, base: dict) -> Param:
    section, _, key = name.partition(".")
    if section not in SECTIONS or section not in SEARCHABLE:
        raise UsageError(f"{where}: unknown config section '{section}' in \"{name}\"; the sections `tfm train` "
                         f"reads: {', '.join(SEARCHABLE)}")
    known = [f.name for f in fields(SECTIONS[section])]
    if key not in known:
        raise UsageError(f"{where}: unknown config field '{name}'; the [{section}] fields: {', '.join(known)}")
    if name in SET_BY_TUNE:
        raise UsageError(f"{where}: {name} is not searched: {SET_BY_TUNE[name]}")
    if not isinstance(spec, dict):
        raise UsageError(f"{where}: \"{name}\" = {spec!r} is no search range; write a table [\"{name}\"] with "
                         "low and high, or choices")
    table = f'["{name}"]'
    unknown = sorted(spec.keys() - RANGE_KEYS - CHOICE_KEYS)
    if unknown:
        raise UsageError(f"{where}: unknown key '{unknown[0]}' in {table}; valid keys: "
                         f"{', '.join(sorted(RANGE_KEYS | CHOICE_KEYS))}")
    if "choices" in spec:
        if spec.keys() & RANGE_KEYS:
            raise UsageError(f"{where}: {table} gives choices and a range; give one of the two")
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices or not all(isinstance(c, (bool, int, float, str))
                                                                   for c in choices):
            raise UsageError(f"{where}: {table} choices must be a non-empty list of numbers, strings or booleans")
        for c in choices:
            _check_value(where, name, "choice", c, base)
        return Param(name, choices=tuple(choices))
    if not {"low", "high"} <= spec.keys():
        raise UsageError(f"{where}: {table} needs low and high, or choices")
    kind = _numeric_kind(SECTIONS[section], key)
    if kind is None:
        raise UsageError(f"{where}: {table} is a range, but {name} is not a number; give its choices instead")
    low, high, log, step = spec["low"], spec["high"], spec.get("log", False), spec.get("step")
    number, takes = (int, "an integer") if kind is int else ((int, float), "a number")
    for what, v in (("low", low), ("high", high), ("step", step)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, number)):
            raise UsageError(f"{where}: {table} {what} = {v!r}: {name} takes {takes}")
    if not isinstance(log, bool):
        raise UsageError(f"{where}: {table} log = {log!r}: expected true or false")
    if low > high:
        raise UsageError(f"{where}: {table} low = {low!r} is above high = {high!r}")
    if step is not None and not step > 0:
        raise UsageError(f"{where}: {table} step = {step!r} must be positive")
    if log and low <= 0:
        raise UsageError(f"{where}: {table} is on a log scale: low must be above 0")
    if log and step is not None and not (kind is int and step == 1):
        raise UsageError(f"{where}: {table} takes log or step, not both")
    for what, v in (("low", low), ("high", high)):
        _check_value(where, name, what, v, base)
    if kind is float:
        low, high, step = float(low), float(high), None if step is None else float(step)
    return Param(name, low, high, log, step, integer=kind is int)


def _numeric_kind(section: type, key: str) -> type | None:
    """int or float for a numeric field (maybe also unset), None for any other."""
    tp = typing.get_type_hints(section)[key]
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return float if float in args else int if int in args else None


def _check_value(where: str, name: str, what: str, value: Any, base: dict) -> None:
    try:
        load_config(None, {name: value}, base)
    except TfmError as e:
        raise UsageError(f"{where}: [\"{name}\"] {what} {value!r} is refused: {e}") from None


def trial_config(base: dict, params: dict[str, Any], out: Path) -> Config:
    """A trial's Config: the base config with the trial's values, training into `out`, never testing."""
    return load_config(None, {**params, "train.output_dir": str(out), "train.test_at_end": False}, base)


# --------------------------------------------------------------------------- the study


@dataclass
class Outcome:
    study: Any  # optuna.Study
    metric: str
    table: str
    best_number: int | None = None
    best_value: float | None = None
    best_dir: Path | None = None
    best_file: Path | None = None


def tune(base: Config, space: str | Path, n_trials: int, study_dir: str | Path, timeout: str | None = None,
         storage: str | None = None, resume: bool = False, pruner=None, sampler=None) -> Outcome:
    """Run trials until the study holds `n_trials` finished or pruned ones (over all its processes) or
    `timeout` ("90m", "2h") has passed (no trial starts after that); then write STUDY_DIR/best.toml. `pruner`
    and `sampler`: Optuna's; default the median pruner and TPE."""
    base_dict = base.to_dict()
    params = read_space(space, base_dict)
    if n_trials < 1:
        raise UsageError(f"--trials {n_trials}: run at least one trial")
    timeout_sec = None if timeout is None else duration_sec(timeout)
    if timeout_sec is not None and not timeout_sec > 0:
        raise UsageError(f'--timeout {timeout!r}: expected a duration such as "90s", "50m", "2h" or "1h30m"')
    study_dir = check_output_path(study_dir, "-o", folder=True, hint="choose another -o")
    metric = base.train.select_metric or "accuracy"
    try:
        import optuna
    except ImportError:
        raise TfmError("tfm tune needs 'pip install transformer-cli[tune]'") from None
    from transformer_cli.training.classify import train  # imports torch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if storage is None:
        study_dir.mkdir(parents=True, exist_ok=True)
        storage = f"sqlite:///{(study_dir / STUDY_FILE).resolve()}"
    study = optuna.create_study(storage=open_storage(storage), study_name=study_dir.resolve().name or "tfm",
                                direction="minimize" if metric == "loss" else "maximize", load_if_exists=True,
                                pruner=pruner or optuna.pruners.MedianPruner(), sampler=sampler)
    _check_study(study, study_dir, base_dict, params, resume)
    deadline = math.inf if timeout_sec is None else time.monotonic() + timeout_sec
    failed_in_row = 0
    while time.monotonic() < deadline:
        _fail_dead_trials(study)
        if counted(study) >= n_trials:
            break
        trial = study.ask()
        trial.set_user_attr("host", HOST)
        trial.set_user_attr("pid", os.getpid())
        if counted(study, below=trial.number) >= n_trials:  # another process took the last trial meanwhile
            trial.set_user_attr("error", "not run: the study had its trials")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            break
        state, why = _run_trial(study, trial, params, base_dict, study_dir, metric, train)
        failed_in_row = failed_in_row + 1 if state is None else 0
        if failed_in_row >= MAX_FAILED_IN_ROW:
            raise TfmError(f"{failed_in_row} trials in a row failed; the last: {why}")
    return finish(study, base_dict, study_dir, metric)


def counted(study, below: int | None = None) -> int:
    """The study's trials that count towards --trials: finished, pruned or running (numbered below `below`)."""
    return sum(t.state.name in ("COMPLETE", "PRUNED", "RUNNING") and (below is None or t.number < below)
               for t in study.get_trials(deepcopy=False))


def open_storage(url: str):
    """Optuna's storage at `url` (SQLite waits up to a minute for another process's write); a TfmError in one
    line, its password hidden, if it cannot be opened."""
    import optuna

    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
    except Exception as e:  # noqa: BLE001 (SQLAlchemy, its drivers and Optuna raise many kinds)
        raise TfmError(f"cannot open the study's storage '{_shown(url)}': {cause_line(e)}") from None


def _shown(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 (not a URL at all: nothing to hide)
        return url


def _check_study(study, study_dir: Path, base: dict, params: list[Param], resume: bool) -> None:
    """A study that holds trials continues only with --resume, and only with the settings it was started with."""
    from transformer_cli.training.run import RESUME_FREE

    trials_dir = study_dir / TRIALS_DIR
    if study.trials and not resume:
        raise UsageError(f"the study '{study.study_name}' already holds {len(study.trials)} trials; pass --resume to "
                         "continue it (or to join it from another process), or choose another -o")
    if not study.trials and trials_dir.is_dir() and any(trials_dir.iterdir()):
        raise UsageError(f"'{trials_dir}' holds trial folders of no study in this storage; choose another -o")
    mine = {"config": {f"{s}.{k}": v for s, values in base.items() for k, v in values.items()
                       if f"{s}.{k}" not in RESUME_FREE},
            "space": {p.name: p.to_dict() for p in params}}
    mine = json.loads(json.dumps(mine))  # as the storage gives it back (tuples as lists)
    theirs = study.user_attrs.get(SETTINGS_ATTR)
    if theirs is None:
        study.set_user_attr(SETTINGS_ATTR, mine)
        return
    diffs = [f"{k}: {theirs[part].get(k)!r} -> {mine[part].get(k)!r}" for part in ("config", "space")
             for k in sorted(theirs[part].keys() | mine[part].keys()) if theirs[part].get(k) != mine[part].get(k)]
    if diffs:
        raise UsageError(f"the study '{study.study_name}' was started with other settings ({'; '.join(diffs[:3])}); "
                         "continue it with the same --config, --space, --data and overrides, or choose another -o")


def _alive(pid: Any) -> bool:
    """Whether process `pid` of this machine runs (this process runs none of its trials between two)."""
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _fail_dead_trials(study) -> None:
    """Trials left running by a process of this machine that died (killed, or the machine restarted): marked
    failed, and their settings tried again in a new trial. Another machine's are left to a --resume there."""
    import optuna

    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if t.user_attrs.get("host") != HOST or _alive(t.user_attrs.get("pid")):
            continue
        try:
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:  # another process did it first
            continue
        study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})


def _run_trial(study, trial, params: list[Param], base: dict, study_dir: Path, metric: str, train):
    """Train one trial and tell the study how it ended: returns (its state, None where it failed and the
    search may go on; why it failed). A stop asked for (Ctrl-C, SIGTERM) fails it, queues its settings to be
    tried again, and is raised, as any error the next trials would meet too."""
    import optuna

    from transformer_cli.training.loop import Aborted, Interrupted

    TrialState = optuna.trial.TrialState
    values = {p.name: p.suggest(trial) for p in params}
    retry = trial.user_attrs.get("retry_of")
    out = study_dir / TRIALS_DIR / f"{trial.number:04d}"
    _say(f"trial {trial.number}{f' (retry of {retry})' if retry is not None else ''}: {_settings(values)}")
    try:
        cfg = trial_config(base, values, out)
    except TfmError as e:
        return None, _fail(study, trial, f"settings refused: {first_line(e)}")
    last = {"step": 0}

    def report(step: int, m: dict) -> None:
        trial.report(m[metric], step)
        last["step"] = step
        if trial.should_prune():
            raise optuna.TrialPruned()

    t0 = time.monotonic()
    try:
        metrics = train(cfg, progress=False, on_validation=report)
    except optuna.TrialPruned:
        trial.set_user_attr("steps", last["step"])
        t = study.tell(trial, state=TrialState.PRUNED)
        _say(f"trial {trial.number}: pruned at step {last['step']}, val {metric} {t.value:.4f} "
             f"({_duration(time.monotonic() - t0)})")
        return TrialState.PRUNED, ""
    except BaseException as e:
        stopped = isinstance(e, (Interrupted, Aborted)) or not isinstance(e, Exception)
        goes_on = isinstance(e, TfmError) and not isinstance(e, UsageError) and not stopped
        why = _fail(study, trial, "stopped" if stopped else first_line(e), warn=goes_on)
        if goes_on:
            return None, why
        if stopped:
            study.enqueue_trial(values, user_attrs={"retry_of": trial.number})  # --resume tries its settings again
        if isinstance(e, (Interrupted, Aborted)):  # a signal: said as the study, not the trial, goes on
            stop = TfmError(f"{first_line(e).split(';')[0]} in trial {trial.number}; `tfm tune ... --resume` "
                            "continues the study, trying its settings again")
            stop.exit_code = e.exit_code
            raise stop from None
        raise
    trial.set_user_attr("steps", metrics["steps"])
    study.tell(trial, metrics["val"][metric])
    _say(f"trial {trial.number}: val {metric} {metrics['val'][metric]:.4f} at step {metrics['best_step']} of "
         f"{metrics['steps']} ({_duration(time.monotonic() - t0)})")
    return TrialState.COMPLETE, ""


def _fail(study, trial, why: str, warn: bool = True) -> str:
    import optuna

    trial.set_user_attr("error", why)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    if warn:
        _say(f"tfm: warning: trial {trial.number} failed: {why}")
    return why


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the end: table and best.toml


def finish(study, base: dict, study_dir: Path, metric: str) -> Outcome:
    """The table of the study's trials and its best one, whose settings go to STUDY_DIR/best.toml."""
    import optuna

    outcome = Outcome(study, metric, trials_table(study, metric))
    try:
        best = study.best_trial
    except ValueError:  # no trial finished
        return outcome
    outcome.best_number, outcome.best_value = best.number, best.value
    outcome.best_dir = study_dir / TRIALS_DIR / f"{best.number:04d}"
    cfg = load_config(None, best.params, base)
    header = (f"# The best settings `tfm tune` found: trial {best.number}, val {metric} {best.value:.4f} "
              f"({len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))} finished trials).\n"
              "# tfm train --config THIS_FILE trains them again.\n")
    outcome.best_file = study_dir / BEST_FILE
    atomic_write_text(outcome.best_file, header + recipe_toml(cfg))
    return outcome


def recipe_toml(cfg: Config) -> str:
    """A recipe file holding only the settings of `cfg` that differ from the defaults."""
    defaults, out = Config().to_dict(), []
    for section, values in cfg.to_dict().items():
        changed = [f"{k} = {_toml(v)}" for k, v in values.items() if v != defaults[section][k] and v is not None]
        if changed:
            out.append(f"[{section}]\n" + "\n".join(changed) + "\n")
    return "\n".join(out)


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(_toml, v)) + "]"
    return json.dumps(str(v), ensure_ascii=False)  # a TOML basic string


def trials_table(study, metric: str) -> str:
    """One row a trial: number, state (and why a failed one failed), settings, val metric, steps and time."""
    trials = study.get_trials(deepcopy=False)
    names = list(dict.fromkeys(name for t in trials for name in t.params))
    retried = {t.user_attrs["retry_of"]: t.number for t in trials if "retry_of" in t.user_attrs}
    rows = [["trial", "state", *names, f"val {metric}", "steps", "time", "note"]]
    for t in trials:
        note = []
        if "retry_of" in t.user_attrs:
            note.append(f"retry of {t.user_attrs['retry_of']}")
        if t.state.name == "FAIL":
            why = t.user_attrs.get("error", "its process died")
            note.append(why if t.number not in retried else f"{why}; retried as {retried[t.number]}")
        rows.append([str(t.number), t.state.name, *(_cell(t.params.get(n)) for n in names),
                     "-" if t.value is None else f"{t.value:.4f}", str(t.user_attrs.get("steps", "-")),
                     "-" if t.duration is None else _duration(t.duration.total_seconds()), "; ".join(note)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _settings(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_cell(v)}" for k, v in values.items())


def _duration(sec: float) -> str:
    return f"{sec:.0f} s" if sec < 120 else f"{sec / 60:.0f} min" if sec < 7200 else f"{sec / 3600:.1f} h"
