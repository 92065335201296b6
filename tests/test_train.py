"""`tfm train`: the schedule, a run's outputs, the step and the loop, the weight average, and resume."""

import itertools
import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_examples, read_scalars, tiny_config, write_jsonl
from safetensors.torch import load_file

from transformer_cli import checkpoint as ckpt
from transformer_cli import runtime
from transformer_cli.config import Config, TrainConfig
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.evaluate import load_model_dir
from transformer_cli.model import CTransformer
from transformer_cli.training import classify, loop
from transformer_cli.training.classify import train
from transformer_cli.training.loop import Ema, Interrupted, lr_at
from transformer_cli.training.run import _check_resume_config, release_output_dirs

# The synthetic train split: 400 examples, 10% held out -> 360; tiny.toml: batch 16, 2 epochs.
N_TRAIN = 360


def steps_per_epoch(cfg) -> int:
    return math.ceil(N_TRAIN / cfg.train.batch_size)


def final_weights(out: Path) -> dict:
    """The weights at the last step (model.safetensors holds the best ones, not the last)."""
    return load_file(ckpt.checkpoint_dirs(out)[-1] / ckpt.MODEL_FILE)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert tensor.equal(b[name]), name


def set_up(cfg, **kw) -> loop.Run:
    """classify.setup's run on the CPU; the output folder's lock, which train() releases at its end, released."""
    try:
        return classify.setup(cfg, runtime.make_runtime("cpu", "fp32"), **kw)
    finally:
        release_output_dirs()


# --------------------------------------------------------------------------- learning-rate schedule


def tc(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": 1e-3, "warmup_steps": 10, **kw})


@pytest.mark.parametrize("config", [tc(), tc(warmup_steps=None, warmup_ratio=0.1)], ids=["steps", "ratio"])
def test_warmup_rises_linearly_to_lr(config):
    values = [lr_at(s, 100, config) for s in range(10)]
    assert values == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
    assert values[0] == pytest.approx(1e-4) and values[-1] == pytest.approx(1e-3)


def test_linear_decay_falls_evenly_to_zero():
    decay = [lr_at(s, 110, tc(schedule="linear")) for s in range(10, 111)]
    assert decay[0] == pytest.approx(1e-3) and decay[50] == pytest.approx(0.5e-3) and decay[-1] == pytest.approx(0)
    steps = [a - b for a, b in itertools.pairwise(decay)]
    assert steps == pytest.approx([steps[0]] * len(steps)) and steps[0] > 0


def test_cosine_decay():
    config = tc(schedule="cosine")
    assert lr_at(10, 110, config) == pytest.approx(1e-3)
    assert lr_at(35, 110, config) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(60, 110, config) == pytest.approx(0.5e-3)
    assert lr_at(110, 110, config) == pytest.approx(0)


def test_constant_schedule_stays_at_lr_after_warmup():
    assert [lr_at(s, 50, tc(schedule="constant")) for s in range(10, 51)] == [1e-3] * 41


# --------------------------------------------------------------------------- a full run


def test_output_directory_holds_exactly_the_documented_files(trained_dir):
    names = sorted(p.name for p in trained_dir.iterdir())
    events = [n for n in names if n.startswith("events.out.tfevents.")]
    assert len(events) == 1
    assert sorted(set(names) - set(events)) == sorted(
        [ckpt.MODEL_FILE, ckpt.CONFIG_FILE, ckpt.TOKENIZER_FILE, ckpt.METRICS_FILE, ckpt.CKPT_DIR, "README.md"])
    # Every checkpoint_every (20) steps and at each epoch's end (23, 46): all kept (trained_run keeps them all).
    steps = sorted(p.name for p in (trained_dir / ckpt.CKPT_DIR).iterdir())
    assert steps == ["step-00000020", "step-00000023", "step-00000040", "step-00000046"]
    for step in steps:  # the best model from the first validation on (the end of epoch 1, step 23)
        files = sorted(p.name for p in (trained_dir / ckpt.CKPT_DIR / step).iterdir())
        best = [ckpt.BEST_FILE] if step >= "step-00000023" else []
        assert files == sorted([ckpt.COMPLETE, ckpt.MODEL_FILE, "state.pt", "trainer.json", *best]), step


def test_metrics_file_matches_the_returned_metrics(trained_run, tiny_cfg):
    out, metrics = trained_run
    assert json.loads((out / ckpt.METRICS_FILE).read_text()) == metrics
    assert metrics["steps"] == steps_per_epoch(tiny_cfg) * tiny_cfg.train.epochs
    assert metrics["val"]["num_examples"] == 400 - N_TRAIN


def test_tensorboard_scalars(trained_run):
    out, metrics = trained_run
    scalars = read_scalars(out)
    required = {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_sec", "val/loss", "val/accuracy"}
    assert required <= scalars.keys()
    for tag, events in scalars.items():
        steps = [s for s, _ in events]
        assert all(a < b for a, b in itertools.pairwise(steps)), tag
    per_epoch = metrics["steps"] // metrics["epochs"]
    assert [s for s, _ in scalars["val/accuracy"]] == [per_epoch * (e + 1) for e in range(metrics["epochs"])]
    assert max(v for _, v in scalars["val/accuracy"]) == pytest.approx(metrics["val"]["accuracy"])


def test_the_model_learns_the_synthetic_task(trained_run):
    _, metrics = trained_run
    assert metrics["val"]["accuracy"] >= 0.85


def test_train_max_length_trains_on_cut_reviews_and_validates_and_reads_whole_ones(synthetic_data_dir, tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(synthetic_data_dir, out, model__pos_emb="rope", data__train_max_length=16, train__max_steps=3)
    run = set_up(cfg)
    assert run.task.lengths.max() == 16 < run.task.val.lengths.max() <= cfg.data.max_length
    assert train(cfg, progress=False)["steps"] == 3
    saved = load_model_dir(out).cfg.data
    assert (saved.max_length, saved.train_max_length) == (cfg.data.max_length, 16)  # predict reads max_length


def test_training_is_reproducible(trained_run, tiny_cfg):
    out, metrics = trained_run
    again = train(tiny_cfg, progress=False)
    for key in ("loss", "accuracy", "confusion_matrix"):
        assert again["val"][key] == metrics["val"][key]
    assert again["best_step"] == metrics["best_step"]
    new_out = Path(tiny_cfg.train.output_dir)
    assert_same_weights(load_file(new_out / ckpt.MODEL_FILE), load_file(out / ckpt.MODEL_FILE))
    assert_same_weights(final_weights(new_out), final_weights(out))


def test_training_into_an_existing_run_is_refused(trained_dir, synthetic_data_dir):
    before = {p.name: p.stat().st_mtime_ns for p in trained_dir.iterdir()}
    with pytest.raises(UsageError, match="already holds a run"):
        train(tiny_config(synthetic_data_dir, trained_dir), progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in trained_dir.iterdir()} == before


def test_a_run_that_died_before_its_first_checkpoint_starts_again_in_its_folder(synthetic_data_dir, tmp_path,
                                                                                   monkeypatch):
    """A crash (kill -9, out of memory) after a validation saved a model but before the first checkpoint
    leaves config.json, tokenizer.json, events and model.safetensors: no run that --resume could
    continue. A fresh start in the folder replaces them; the dead run's curves do not mix in."""
    real = loop.lr_at

    def crash_at_step_7(step, *args):
        if step == 7:
            raise RuntimeError("killed")
        return real(step, *args)

    cfg = tiny_config(synthetic_data_dir, tmp_path / "run", train__eval_every=5, train__checkpoint_every=100,
                      train__max_steps=10)
    monkeypatch.setattr(loop, "lr_at", crash_at_step_7)  # the one patch: the crash, at step 7
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg, progress=False)
    monkeypatch.undo()
    out = Path(cfg.train.output_dir)
    assert (out / ckpt.MODEL_FILE).exists() and ckpt.checkpoint_dirs(out) == []
    with pytest.raises(UsageError, match="no complete checkpoint"):
        train(cfg, resume=True, progress=False)
    assert train(cfg, progress=False)["steps"] == 10
    steps = [s for s, _ in read_scalars(out)["train/lr"]]
    assert steps == sorted(set(steps)) and steps[0] > 0  # one run's curve: no step twice


@pytest.mark.parametrize("max_steps", [20, 46], ids=["mid-epoch", "epoch-ends"])  # 23 steps an epoch
def test_the_last_step_is_validated_and_saved_once(synthetic_data_dir, tmp_path, max_steps):
    """A step that is both a multiple of eval_every/checkpoint_every and the run's (or an epoch's)
    last is validated and checkpointed once, not once in the loop and again after it."""
    out, half = tmp_path / "run", max_steps // 2
    train(tiny_config(synthetic_data_dir, out, train__max_steps=max_steps, train__eval_every=half,
                      train__checkpoint_every=half), progress=False)
    assert [s for s, _ in read_scalars(out)["val/accuracy"]] == [half, max_steps]
    assert [p.name for p in ckpt.checkpoint_dirs(out)] == [f"step-{half:08d}", f"step-{max_steps:08d}"]


def test_accumulated_micro_batches_of_unequal_sizes_weigh_every_example_equally(synthetic_data_dir, tmp_path):
    """One step over 12 examples: a batch of 12, or micro-batches of 8 and 4 accumulated (as when an
    epoch's last batch is short), must give the same gradient. (Not the same weights after the step:
    Adam's first step moves each weight by about lr * g / (|g| + eps), so a gradient entry near eps
    turns float summation order into differences of 1e-5.)"""
    idx = np.arange(12)
    grads, results = {}, {}
    for accum, plan in {1: [idx], 2: [idx[:8], idx[8:]]}.items():
        run = set_up(tiny_config(synthetic_data_dir, tmp_path / f"accum{accum}"))  # the same initial weights
        grads[accum] = seen = {}
        for name, p in run.model.named_parameters():  # the gradient as accumulated, before clipping
            p.register_post_accumulate_grad_hook(lambda p, name=name, seen=seen: seen.update({name: p.grad.clone()}))
        results[accum] = loop.train_step(run, [run.task.batch(run.rt, i) for i in plan])
    scale = max(g.abs().max().item() for g in grads[1].values())
    assert grads[1].keys() == grads[2].keys() and len(grads[1]) > 0 and scale > 0
    for name, a in grads[2].items():  # equal up to float summation order
        torch.testing.assert_close(a, grads[1][name], rtol=1e-4, atol=1e-6 * scale, msg=lambda m, n=name: f"{n}: {m}")
    assert results[2].stats["loss"] == pytest.approx(results[1].stats["loss"], rel=1e-6)  # the mean over all 12
    assert results[1].samples == results[2].samples == 12


def test_checkpoint_every_0_checkpoints_at_epoch_ends_only(synthetic_data_dir, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(synthetic_data_dir, out, train__checkpoint_every=0), progress=False)
    assert [p.name for p in ckpt.checkpoint_dirs(out)] == ["step-00000023", "step-00000046"]


def test_samples_per_sec_leaves_validation_and_checkpoints_out(synthetic_data_dir, tmp_path, monkeypatch):
    """On a clock that advances 1 ms per reading and 1,000 s per validation or checkpoint, each logged
    train/samples_per_sec is that of the steps alone; train_time_sec, the loop's wall time, has them."""
    import time as real_time

    class Clock:
        now = 0.0

        def perf_counter(self) -> float:
            self.now += 1e-3
            return self.now

        def __getattr__(self, name):
            return getattr(real_time, name)

    def taking_1000_s(fn):
        def slow(*args):
            clock.now += 1000
            return fn(*args)
        return slow

    # The loop's clocks replaced (loop.clock is there to be) and validation and checkpoints made to take 1,000 s
    # each on them: in a real run they take too little time to tell apart from the steps'.
    clock = Clock()
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(loop, "clock", clock.perf_counter)
    for name in ("validate", "save_checkpoint"):
        monkeypatch.setattr(loop, name, taking_1000_s(getattr(loop, name)))
    out = tmp_path / "run"
    metrics = train(tiny_config(synthetic_data_dir, out, train__max_steps=20, train__log_every=4,
                                train__eval_every=6, train__checkpoint_every=7), progress=False)
    speeds = read_scalars(out)["train/samples_per_sec"]
    assert [s for s, _ in speeds] == [4, 8, 12, 16, 20]
    assert min(v for _, v in speeds) > 64 / 1.0  # 4 steps of 16 samples took well under a second ...
    # ... while the loop's time has validations at 6, 12, 18 and 20 and checkpoints at 7, 14 and 20
    assert 7000 < metrics["train_time_sec"] < 7001


# --------------------------------------------------------------------------- resume


def test_resume_after_max_steps_equals_an_uninterrupted_run(synthetic_data_dir, tmp_path, monkeypatch):
    """With dropout, word dropout and bf16 autocast: the resumed run draws the same random numbers."""
    model = {"model__dropout": 0.1, "model__token_dropout": 0.5, "train__precision": "bf16"}
    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: True)  # where bf16 is emulated: slower, as exact

    # The schedule must not depend on the total number of steps (which max_steps changes): constant
    # learning rate after a warmup given in steps.
    def cfg(name, **kw):
        return tiny_config(synthetic_data_dir, tmp_path / name, train__epochs=1, train__schedule="constant",
                           train__warmup_steps=5, **model, **kw)

    train(cfg("full"), progress=False)
    assert train(cfg("split", train__max_steps=10), progress=False)["steps"] == 10
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path / "split")] == ["step-00000010"]
    with pytest.raises(UsageError, match="max_steps"):
        train(cfg("split"), resume=True, progress=False)  # max_steps changed: refused without force
    resumed = train(cfg("split"), resume=True, force=True, progress=False)
    assert resumed["steps"] == steps_per_epoch(cfg("x"))
    assert_same_weights(final_weights(tmp_path / "split"), final_weights(tmp_path / "full"))


def test_resume_after_a_signal_between_two_logs_equals_an_uninterrupted_run(trained_run, tiny_cfg, monkeypatch):
    """Stopped at step 7 (log_every = 5): the resumed run logs the same means at step 10, from the sums it saved."""
    out, metrics = trained_run
    stop_after = 7
    real_lr_at = loop.lr_at

    def interrupting_lr_at(step, *args):
        if step == stop_after - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the trainer: finish the step, checkpoint
        return real_lr_at(step, *args)

    monkeypatch.setattr(loop, "lr_at", interrupting_lr_at)  # the one patch: a real signal, during step 7
    with pytest.raises(Interrupted) as e:
        train(tiny_cfg, progress=False)
    assert e.value.exit_code == 128 + signal.SIGTERM
    split = Path(tiny_cfg.train.output_dir)
    assert [p.name for p in ckpt.checkpoint_dirs(split)] == [f"step-{stop_after:08d}"]

    monkeypatch.undo()
    resumed = train(tiny_cfg, resume=True, progress=False)
    assert (resumed["steps"], resumed["best_step"]) == (metrics["steps"], metrics["best_step"])
    assert resumed["val"]["loss"] == metrics["val"]["loss"]
    assert_same_weights(final_weights(split), final_weights(out))
    assert_same_weights(load_file(split / ckpt.MODEL_FILE), load_file(out / ckpt.MODEL_FILE))

    # The two event files read as one history: no step logged twice, same training losses.
    resumed_loss, full_loss = (read_scalars(d)["train/loss"] for d in (split, out))
    assert [s for s, _ in resumed_loss] == [s for s, _ in full_loss]
    assert [v for _, v in resumed_loss] == pytest.approx([v for _, v in full_loss], abs=1e-6)


# --------------------------------------------------------------------------- weight averaging


def test_ema_follows_the_warm_started_formula_and_swaps_back():
    model = torch.nn.Linear(3, 2)
    ema = Ema(model, decay=0.9)
    expected = [p.detach().clone() for p in model.parameters()]
    for step in range(30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ema.update(step)
        d = min(0.9, (1 + step) / (10 + step))
        expected = [d * e + (1 - d) * p.detach() for e, p in zip(expected, model.parameters())]
    for s, e in zip(ema.shadow, expected):
        torch.testing.assert_close(s, e)
    own = [p.detach().clone() for p in model.parameters()]
    with ema.swapped_in():
        for p, s, o in zip(model.parameters(), ema.shadow, own):
            assert p.equal(s) and not p.equal(o)
    for p, o in zip(model.parameters(), own):
        assert p.equal(o)


def test_the_saved_model_is_the_weight_average(synthetic_data_dir, tmp_path):
    """With train.ema_decay, validation scores the average and saves it, not the last raw weights. (That
    a resume continues the average exactly: test_faults.)"""
    out = tmp_path / "run"
    metrics = train(tiny_config(synthetic_data_dir, out, train__epochs=1, train__ema_decay=0.9), progress=False)
    assert metrics["best_step"] == metrics["steps"]  # one validation, at the last step
    last = ckpt.checkpoint_dirs(out)[-1]
    average = ckpt.load_checkpoint(last)[1]["ema"]
    saved, raw = load_model_dir(out).model, load_file(last / ckpt.MODEL_FILE)
    assert all(p.equal(a) for p, a in zip(saved.parameters(), average, strict=True))
    assert any(not p.equal(raw[name]) for name, p in saved.named_parameters())


def test_a_forced_resume_uses_the_new_optimizer_settings(synthetic_data_dir, tmp_path):
    def cfg(**kw):
        return tiny_config(synthetic_data_dir, tmp_path / "run", model__n_layers=2, **kw)

    train(cfg(train__max_steps=2, train__layer_lr_decay=0.8), progress=False)
    new = cfg(train__max_steps=3, train__weight_decay=0.0, train__beta2=0.9, train__layer_lr_decay=0.5)
    train(new, resume=True, force=True, progress=False)
    _, tensors = ckpt.load_checkpoint(ckpt.checkpoint_dirs(tmp_path / "run")[-1])
    groups = tensors["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.0] * len(groups)
    assert all(tuple(g["betas"]) == (0.9, 0.9) for g in groups)
    model = CTransformer(new.model, new.data.vocab_size, new.data.max_length)
    assert [g["lr_scale"] for g in groups] == [g["lr_scale"] for g in model.param_groups(0.0, 0.5)]
    assert min(g["lr_scale"] for g in groups) == 0.5 ** 3  # the embeddings, below two blocks


def test_checkpoints_keep_the_random_state_of_the_runs_own_gpu(monkeypatch):
    """Only the run's GPU: a resume that sees fewer GPUs, or other ones, still restores it."""
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.tensor([device.index], dtype=torch.uint8))
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state.tolist(), device)))
    gpu = torch.device("cuda", 1)
    json_part, tensors = loop._rng_state(gpu)
    assert tensors["cuda"].tolist() == [1]
    loop._set_rng_state(json_part, tensors, gpu)
    every_gpu = [torch.tensor([7], dtype=torch.uint8), torch.tensor([8], dtype=torch.uint8)]  # older checkpoints
    loop._set_rng_state(json_part, {**tensors, "cuda": every_gpu}, gpu)
    loop._set_rng_state(json_part, {**tensors, "cuda": every_gpu}, torch.device("cuda", 2))  # not saved: left
    loop._set_rng_state(json_part, tensors, torch.device("cpu"))  # a CPU run leaves the GPUs alone
    assert restored == [([1], gpu), ([8], gpu)]
    assert "cuda" not in loop._rng_state(torch.device("cpu"))[1]


def test_a_forced_resume_with_larger_batches_goes_on_from_the_next_epoch(synthetic_data_dir, tmp_path, monkeypatch):
    """Saved 20 batches into an epoch that now has fewer than 20: the run starts the next epoch (it
    used to loop without end, rebuilding that epoch's batches)."""
    out = tmp_path / "run"
    train(tiny_config(synthetic_data_dir, out, train__batch_size=8, train__max_steps=20), progress=False)
    saved, _ = ckpt.load_checkpoint(ckpt.checkpoint_dirs(out)[-1])
    assert (saved["state"]["epoch"], saved["state"]["batch_in_epoch"]) == (0, 20)  # 45 batches an epoch of 8

    epochs_built = []  # the loop builds each epoch's batches once; a loop that spins builds them again and again

    def step_groups(*args):
        epochs_built.append(1)
        if len(epochs_built) > 10:
            raise RuntimeError("the resumed run keeps rebuilding an epoch's batches")
        return real_step_groups(*args)

    real_step_groups = loop.step_groups
    monkeypatch.setattr(loop, "step_groups", step_groups)  # a spy that turns the old endless loop into an error
    resumed = train(tiny_config(synthetic_data_dir, out, train__batch_size=32, train__max_steps=24), resume=True,
                    force=True, progress=False)
    assert resumed["steps"] == 24
    state = ckpt.load_checkpoint(ckpt.checkpoint_dirs(out)[-1])[0]["state"]
    assert (state["epoch"], state["batch_in_epoch"]) == (1, 4)  # epoch 1 from its start, in batches of 32


def test_a_forced_resume_that_changes_the_model_picks_its_best_anew(synthetic_data_dir, tmp_path):
    """config.json is the new model's: the best weights validated before the change, which it would not
    describe (another pooling, the same shapes), are not kept beside it; a change of training alone
    keeps them."""
    out = tmp_path / "run"
    first = train(tiny_config(synthetic_data_dir, out, train__max_steps=8), progress=False)
    assert first["best_step"] == 8
    kept = set_up(tiny_config(synthetic_data_dir, out, train__max_steps=10, train__lr=1e-4), resume=True, force=True)
    assert kept.state.best_step == 8 and (out / ckpt.MODEL_FILE).exists()
    changed = set_up(tiny_config(synthetic_data_dir, out, train__max_steps=10, model__pooling="first"), resume=True,
                     force=True)
    assert changed.state.best_step == -1 and changed.state.best_val == {}
    assert not (out / ckpt.MODEL_FILE).exists()  # until the next validation saves the new model's
    resumed = train(tiny_config(synthetic_data_dir, out, train__max_steps=10, model__pooling="first"), resume=True,
                    force=True, progress=False)
    assert resumed["best_step"] == 10 and load_model_dir(out)[1].model.pooling == "first"


@pytest.mark.parametrize("change", [{"model__n_layers": 2}, {"model__d_model": 64}])
def test_a_forced_resume_that_changes_the_weights_shapes_is_a_usage_error_naming_the_setting(synthetic_data_dir,
                                                                                               tmp_path, change):
    out = tmp_path / "run"
    train(tiny_config(synthetic_data_dir, out, train__max_steps=4, train__checkpoint_every=4), progress=False)
    kept = (out / ckpt.MODEL_FILE).read_bytes()
    key = next(iter(change)).replace("__", ".")
    with pytest.raises(UsageError, match=rf"^{re.escape(key)} changed, and the checkpoint's weights do not fit .* "
                                         r"--force accepts only changes that keep the weights' shapes"):
        train(tiny_config(synthetic_data_dir, out, train__max_steps=8, **change), resume=True, force=True,
              progress=False)
    assert (out / ckpt.MODEL_FILE).read_bytes() == kept


@pytest.mark.parametrize("before, after", [(1.0, 0.8), (0.8, 1.0)])
def test_a_forced_resume_that_makes_or_undoes_groups_per_layer_is_a_usage_error(synthetic_data_dir, tmp_path, before,
                                                                                 after):
    out = tmp_path / "run"
    train(tiny_config(synthetic_data_dir, out, train__max_steps=2, train__layer_lr_decay=before), progress=False)
    changed = rf"^train.layer_lr_decay changed from {before} to {after}, .* start a new run"
    with pytest.raises(UsageError, match=changed):
        train(tiny_config(synthetic_data_dir, out, train__max_steps=3, train__layer_lr_decay=after), resume=True,
              force=True, progress=False)


def test_a_forced_resume_can_turn_the_weight_average_on(synthetic_data_dir, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(synthetic_data_dir, out, train__max_steps=3, train__ema_decay=0.0), progress=False)  # no average
    assert "ema" not in ckpt.load_checkpoint(ckpt.checkpoint_dirs(out)[-1])[1]
    resumed = train(tiny_config(synthetic_data_dir, out, train__max_steps=6, train__ema_decay=0.9), resume=True,
                    force=True, progress=False)
    assert resumed["steps"] == 6
    assert "ema" in ckpt.load_checkpoint(ckpt.checkpoint_dirs(out)[-1])[1]


@pytest.mark.parametrize(("key", "value", "free"), [
    ("train.log_every", 7, True), ("train.eval_batch_size", 8, True), ("train.checkpoint_every", 3, True),
    ("train.lr", 0.5, False), ("pretrain.mask_prob", 0.2, False), ("data.vocab_size", 500, False),
])
def test_only_settings_that_leave_training_unchanged_may_differ_on_resume(key, value, free):
    now = Config()
    saved = now.to_dict()
    section, name = key.split(".")
    saved[section][name] = value
    if free:
        _check_resume_config(saved, now, 1, 1, force=False)
    else:
        with pytest.raises(UsageError, match=rf"{key}: {value!r} ->"):
            _check_resume_config(saved, now, 1, 1, force=False)
    _check_resume_config(saved, now, 1, 1, force=True)


def test_a_checkpoint_of_an_older_version_resumes_unless_a_setting_it_had_changed_its_training(trained_run,
                                                                                             synthetic_data_dir,
                                                                                             tmp_path):
    """Fields this version no longer has (config.REMOVED_FIELDS): at a value that trains as this version does
    they are dropped and the run resumes without --force; at another it is refused in one line, naming it."""
    out = Path(shutil.copytree(trained_run[0], tmp_path / "run"))
    first = ckpt.checkpoint_dirs(out)[0]
    state = json.loads((first / "trainer.json").read_text())
    state["config"]["train"].update(keep_checkpoints=5, label_smoothing=0.0)
    state["config"]["data"]["cache_dir"] = "/elsewhere"
    (first / "trainer.json").write_text(json.dumps(state))
    smoothed = Path(shutil.copytree(first, tmp_path / "smoothed"))
    resumed = train(tiny_config(synthetic_data_dir, out), resume=str(first), progress=False)
    assert resumed["steps"] == trained_run[1]["steps"]
    state["config"]["train"]["label_smoothing"] = 0.1
    (smoothed / "trainer.json").write_text(json.dumps(state))
    with pytest.raises(TfmError, match=r"was made with train.label_smoothing = 0.1, which this version of tfm no "
                                       r"longer has") as info:
        train(tiny_config(synthetic_data_dir, tmp_path / "new"), resume=str(smoothed), progress=False)
    assert "\n" not in str(info.value)


def test_a_run_that_held_out_part_of_train_does_not_switch_to_a_validation_split_on_resume(synthetic_data_dir,
                                                                                         tmp_path):
    data = tmp_path / "data"
    shutil.copytree(synthetic_data_dir, data)
    cfg = tiny_config(data, tmp_path / "run", train__max_steps=4, train__checkpoint_every=2)
    train(cfg, progress=False)
    first = ckpt.checkpoint_dirs(tmp_path / "run")[0]
    for saved in (json.loads((first / "trainer.json").read_text())["config"],
                  json.loads((tmp_path / "run" / ckpt.CONFIG_FILE).read_text())):
        assert saved["data"]["val_split"] == ""  # what it did: no such split, so part of train held out
    write_jsonl(data / "validation.jsonl", make_examples(30, seed=9))  # the dataset now has its own
    with pytest.raises(UsageError, match="data.val_split: '' -> 'validation'"):
        train(cfg, resume=str(first), progress=False)
    resumed = train(cfg.replace(data={"val_split": ""}), resume=str(first), progress=False)
    assert resumed["steps"] == 4 and resumed["val"]["num_examples"] == 40  # 10% of train, not the 30 new ones


def test_an_output_dir_that_is_a_file_is_refused_before_anything_runs(synthetic_data_dir, tmp_path):
    path = tmp_path / "afile"
    path.write_text("keep me")
    with pytest.raises(UsageError, match="output directory '.*afile' is a file; choose another --output-dir"):
        train(tiny_config(synthetic_data_dir, path), progress=False)
    assert path.read_text() == "keep me"


def test_an_output_dir_that_cannot_be_written_is_refused_before_anything_runs(synthetic_data_dir, tmp_path,
                                                                               monkeypatch):
    import os

    denied = tmp_path / "locked"
    denied.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != denied and access(p, mode))  # as if chmod 555
    with pytest.raises(UsageError, match=f"'{denied / 'run'}' cannot be written \\('{denied}' is not writable\\)"):
        train(tiny_config(synthetic_data_dir, denied / "run"), progress=False)
    assert list(denied.iterdir()) == []


def test_an_output_dir_that_cannot_be_created_names_it(synthetic_data_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    mkdir = Path.mkdir

    def refusing(self, *args, **kwargs):
        if self == out:
            raise OSError(2, "No such file or directory", str(self))  # as under /proc
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refusing)
    with pytest.raises(UsageError, match="cannot create output directory '.*run' \\(No such file or directory\\)"):
        train(tiny_config(synthetic_data_dir, out), progress=False)


def test_resume_from_another_runs_checkpoint_goes_to_a_new_folder_only(trained_run, synthetic_data_dir, tmp_path):
    source, source_metrics = trained_run
    first = ckpt.checkpoint_dirs(source)[0]
    other = tmp_path / "other"
    train(tiny_config(synthetic_data_dir, other, train__max_steps=3, model__d_model=16), progress=False)
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    with pytest.raises(UsageError, match="already holds a run"):
        train(tiny_config(synthetic_data_dir, other), resume=str(first), progress=False)
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before
    fresh = tmp_path / "fresh"
    resumed = train(tiny_config(synthetic_data_dir, fresh), resume=str(first), progress=False)
    assert resumed["steps"] == source_metrics["steps"]
    assert (fresh / ckpt.TOKENIZER_FILE).read_text() == (source / ckpt.TOKENIZER_FILE).read_text()


@pytest.mark.parametrize("config", ['{"architectures": ["BertModel"]}', "{damaged", None],
                         ids=["another-programs", "damaged", "none"])
def test_a_model_beside_no_config_of_a_tfm_run_is_never_replaced(tiny_cfg, config):
    """A folder of another program's model (or a copied model whose config.json is damaged or missing) is
    no run that died before its first checkpoint: a fresh start there is refused and touches nothing, and
    the message does not send the user to --resume, which has nothing to continue."""
    out = Path(tiny_cfg.train.output_dir)
    out.mkdir()
    files = {ckpt.CONFIG_FILE: config, ckpt.TOKENIZER_FILE: "{}", ckpt.MODEL_FILE: "weights"}
    files = {name: text for name, text in files.items() if text is not None}
    for name, text in files.items():
        (out / name).write_text(text)
    no_run = r"holds a model.safetensors that is no tfm run's .*choose another --output-dir$"
    with pytest.raises(UsageError, match=no_run):
        train(tiny_cfg, progress=False)
    assert {p.name: p.read_text() for p in out.iterdir()} == files


def test_a_run_branched_into_a_new_folder_keeps_the_checkpoints_best_model(synthetic_data_dir, tmp_path,
                                                                            monkeypatch):
    """The best model is part of a checkpoint: resumed into a new folder from a checkpoint after the best
    validation, model.safetensors is the best as of that checkpoint, which no later validation beats."""
    monkeypatch.setattr(loop, "KEEP_CHECKPOINTS", 100)
    kw = {"train__epochs": 4, "train__eval_every": 4, "train__select_metric": "loss"}  # checkpoints every 20 steps
    source = tmp_path / "source"
    m = train(tiny_config(synthetic_data_dir, source, **kw), progress=False)
    after = next(d for d in ckpt.checkpoint_dirs(source) if int(d.name.split("-")[1]) > m["best_step"])
    assert after != ckpt.checkpoint_dirs(source)[-1]  # some training follows it
    assert (after / ckpt.BEST_FILE).read_bytes() == (source / ckpt.MODEL_FILE).read_bytes()
    branch = tmp_path / "branch"
    resumed = train(tiny_config(synthetic_data_dir, branch, **kw), resume=str(after), progress=False)
    assert resumed["best_step"] == m["best_step"]
    assert (branch / ckpt.MODEL_FILE).read_bytes() == (source / ckpt.MODEL_FILE).read_bytes()


def test_a_damaged_best_model_in_the_checkpoint_is_refused_and_the_outputs_model_kept(synthetic_data_dir, tmp_path):
    out = tmp_path / "run"
    kw = {"train__max_steps": 8, "train__eval_every": 4, "train__checkpoint_every": 4}
    train(tiny_config(synthetic_data_dir, out, **kw), progress=False)
    kept = (out / ckpt.MODEL_FILE).read_bytes()
    last = ckpt.checkpoint_dirs(out)[-1]
    (last / ckpt.BEST_FILE).unlink()  # a hard link to an earlier model file: cut a copy, not the model
    (last / ckpt.BEST_FILE).write_bytes(kept[:3000])
    with pytest.raises(TfmError, match=rf"weights file '.*{ckpt.BEST_FILE}' is damaged"):
        train(tiny_config(synthetic_data_dir, out, **kw), resume=True, progress=False)
    assert (out / ckpt.MODEL_FILE).read_bytes() == kept


@pytest.mark.parametrize(("name", "text", "message"), [
    ("trainer.json", "[]", "is not a tfm checkpoint's"), ("trainer.json", "{}", "is not a tfm checkpoint's"),
    (ckpt.TOKENIZER_FILE, '{"version": "1.0", "trunc', "tokenizer '.*' is unreadable"),
])
def test_a_checkpoint_with_an_odd_file_is_refused_in_one_line(synthetic_data_dir, tmp_path, name, text, message):
    out = tmp_path / "run"
    train(tiny_config(synthetic_data_dir, out, train__max_steps=4, train__checkpoint_every=4), progress=False)
    (ckpt.checkpoint_dirs(out)[-1] / name if name == "trainer.json" else out / name).write_text(text)
    with pytest.raises(TfmError, match=message) as info:
        train(tiny_config(synthetic_data_dir, out, train__max_steps=8), resume=True, progress=False)
    assert "\n" not in str(info.value)


def test_resuming_from_an_earlier_checkpoint_abandons_the_later_ones(synthetic_data_dir, tmp_path, monkeypatch):
    """Back to step 8 of a 20-step run, in its own folder: its model becomes step 8's best again, and the
    first new checkpoint removes the later ones, so that --resume continues the new run, not the old."""
    monkeypatch.setattr(loop, "KEEP_CHECKPOINTS", 100)
    kw = {"train__max_steps": 20, "train__eval_every": 4, "train__checkpoint_every": 4}
    out = tmp_path / "run"
    train(tiny_config(synthetic_data_dir, out, **kw), progress=False)
    step8 = out / ckpt.CKPT_DIR / "step-00000008"
    best8 = (step8 / ckpt.BEST_FILE).read_bytes()
    train(tiny_config(synthetic_data_dir, out, train__max_steps=8), resume=str(step8), force=True, progress=False)
    assert (out / ckpt.MODEL_FILE).read_bytes() == best8
    train(tiny_config(synthetic_data_dir, out, **{**kw, "train__max_steps": 10, "train__lr": 1e-3}),
          resume=str(step8), force=True, progress=False)
    assert [p.name for p in ckpt.checkpoint_dirs(out)][-1] == "step-00000010"


def test_a_resumed_runs_event_file_sorts_after_one_from_the_same_second(tmp_path):
    import time

    rt = runtime.make_runtime("cpu", "fp32")
    before = int(time.time())
    first = loop.Logger(tmp_path, rt)
    first.scalars(1, {"train/loss": 1.0})
    first.close()
    (written,) = tmp_path.glob("events.out.tfevents.*")
    second = int(written.name.split(".")[3])  # named by its creation second, then host, process id, counter
    assert before <= second <= int(time.time())
    # As if written on a host and by a process that sort after ours: a new file of this second sorts first.
    earlier = written.rename(tmp_path / f"events.out.tfevents.{second:010d}.zzzz.99999999.0")
    resumed = loop.Logger(tmp_path, rt, purge_step=2)
    resumed.scalars(2, {"train/loss": 2.0})
    resumed.close()
    assert read_scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0)]
    newest = max(tmp_path.glob("events.out.tfevents.*"), key=lambda p: p.name)
    assert newest != earlier and int(newest.name.split(".")[3]) > second
