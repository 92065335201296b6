"""train.time_budget: the schedule follows the budget's elapsed share, and the run ends within it with its best
model, also when killed and resumed. The loop's clock is replaced by a fake one: no test waits."""

from __future__ import annotations

import json

import pytest
from conftest import read_scalars, tiny_config

from transformer_cli.config import duration_sec, load_config
from transformer_cli.errors import UsageError
from transformer_cli.training import loop
from transformer_cli.training.classify import train
from transformer_cli.training.loop import lr_at


class FakeClock:
    """Seconds that advance by `tick` at every reading, as if each step took a fixed time."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("50m", 3000), ("2h", 7200), ("1h30m", 5400),
                                               ("1.5h", 5400)])
def test_durations(text, seconds):
    assert duration_sec(text) == seconds


@pytest.mark.parametrize("text", ["0m", "-5m", "soon", "5", "2 hours", ""])
def test_a_budget_that_is_no_positive_duration_is_a_usage_error(text):
    with pytest.raises(UsageError, match=r"train.time_budget = .*must be a positive duration such as \"90s\""):
        load_config(None, {"train.time_budget": text})


def test_the_schedule_follows_the_budget():
    tc = load_config(None, {"train.time_budget": "100s", "train.warmup_ratio": 0.1}).train
    assert lr_at(0, 10_000, tc, elapsed=5.0) == pytest.approx(tc.lr * 0.5)  # half way through warmup
    assert lr_at(0, 10_000, tc, elapsed=10.0) == pytest.approx(tc.lr)
    assert lr_at(0, 10_000, tc, elapsed=55.0) == pytest.approx(tc.lr * 0.5)  # half way through the decay
    assert lr_at(0, 10_000, tc, elapsed=100.0) == 0.0
    assert lr_at(9_999, 10_000, tc, elapsed=1.0) == 0.0  # the steps, where they run out first


BUDGET, BOUND = 7200, 144  # 2 hours, and the bound a run must end within: 2% of it (or 30 s, if more)


def test_a_budgeted_run_ends_within_its_budget_with_its_best_model(synthetic_data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "clock", FakeClock(10.0))
    cfg = tiny_config(synthetic_data_dir, tmp_path / "run", train__time_budget="2h", train__epochs=100)
    metrics = train(cfg, progress=False)
    assert metrics["stop_reason"] == "time_budget"
    assert BUDGET - BOUND <= metrics["train_time_sec"] <= BUDGET + BOUND
    assert metrics["steps"] < 100 * 23  # the epochs would have run longer
    assert json.loads((tmp_path / "run" / "config.json").read_text())["steps"] == metrics["steps"]
    lrs = [v for _, v in read_scalars(tmp_path / "run")["train/lr"]]
    assert max(lrs) == pytest.approx(cfg.train.lr, rel=0.2) and lrs[-1] < 0.25 * cfg.train.lr  # decayed by the end
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_a_budget_shorter_than_the_warmup_still_saves_a_model(synthetic_data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "clock", FakeClock(1.0))
    cfg = tiny_config(synthetic_data_dir, tmp_path / "run", train__time_budget="3s", train__warmup_ratio=0.5)
    metrics = train(cfg, progress=False)
    assert metrics["stop_reason"] == "time_budget" and metrics["steps"] >= 1
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_a_run_killed_and_resumed_ends_within_the_same_budget(synthetic_data_dir, tmp_path, monkeypatch):
    clock = FakeClock(10.0)
    cfg = tiny_config(synthetic_data_dir, tmp_path / "run", train__time_budget="2h", train__epochs=100,
                      train__checkpoint_every=50)

    class Killed(Exception):
        pass

    def dies_after_an_hour():
        if clock.now >= 3600:
            raise Killed
        return FakeClock.__call__(clock)

    monkeypatch.setattr(loop, "clock", dies_after_an_hour)
    with pytest.raises(Killed):
        train(cfg, progress=False)
    monkeypatch.setattr(loop, "clock", FakeClock(10.0))
    metrics = train(cfg, resume=True, progress=False)
    assert metrics["stop_reason"] == "time_budget"
    assert BUDGET - BOUND <= metrics["train_time_sec"] <= BUDGET + BOUND
