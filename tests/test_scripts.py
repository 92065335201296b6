"""The scripts: bench.py's comparisons at tiny sizes and its load test's pieces, reproduce_imdb.py's plan of
`tfm` commands, tfidf_baseline.py on synthetic data."""

import contextlib
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CONFIGS, REPO

from transformer_cli.config import load_config


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench, reproduce = script("bench"), script("reproduce_imdb")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


# --------------------------------------------------------------------------- bench.py


def test_the_baseline_has_tfms_sizes_and_dropout_and_reads_the_same_mask():
    pytest.importorskip("transformers")
    cfg = load_config(CONFIGS / "seed.toml")
    tfm, hf = bench.models(cfg, 700, 300, 2, 0)
    c = hf.config
    assert (c.hidden_size, c.num_attention_heads, c.num_hidden_layers, c.intermediate_size) == (128, 8, 3, 512)
    assert (c.vocab_size, c.max_position_embeddings, c.hidden_dropout_prob) == (700, 300, 0.2)
    assert c.attention_probs_dropout_prob == 0.0 and c._attn_implementation == "sdpa"
    assert tfm.encoder.tok_emb.weight.shape == hf.bert.embeddings.word_embeddings.weight.shape
    ids, mask, _ = bench.random_batches(1, 3, 12, 700, 0, "cpu")[0]
    mask = mask.clone()
    mask[0, 6:] = False
    other = ids.clone()
    other[0, 6:] = 9  # other ids where the mask says padding
    steps = bench.steps_of(tfm, hf, bench.make_runtime("cpu", "fp32"), cfg.train, training=False)
    for step in steps.values():
        assert torch.allclose(step((ids, mask)), step((other, mask)), atol=1e-5)
        assert step((ids, mask)).shape == (3, 2)


def test_padding_to_the_longest_keeps_each_reviews_ids_as_collate_does():
    from transformer_cli.data import Encoded, collate

    lengths = [3, 7, 5]
    ids = np.arange(1, sum(lengths) + 1, dtype=np.int32)
    enc = Encoded(ids, np.concatenate([[0], np.cumsum(lengths)]), np.array([0, 1, 0]))
    idx = np.array([2, 0])
    got, mask, labels = bench.padded(enc, idx)
    want, want_mask, _ = collate(enc, idx)  # padded to a multiple of 32, up to the longest review
    assert got.shape == (2, 5) and labels.tolist() == [0, 0]
    assert (got == want[:, :5]).all() and (mask == want_mask[:, :5]).all() and mask.sum(1).tolist() == [5, 3]


@pytest.mark.parametrize("command", ["train", "infer"])
def test_bench_compares_both_models_on_equal_work_and_on_reviews(command, synthetic_data_dir, capsys):
    pytest.importorskip("transformers")
    code = bench.main([command, "--config", str(CONFIGS / "tiny.toml"), "--data", str(synthetic_data_dir),
                       "--samples", "48", "--steps", "1", "--warmup", "0", "--rounds", "1", "--seq-len", "16",
                       "--batch-size", "8", "--precision", "fp32"])
    out = capsys.readouterr().out
    assert code == 0
    assert "CPU: " in out.splitlines()[1]
    assert "(a) equal work" in out and "ratio steps/s (a), tfm / HF" in out
    assert "(b) 48 train reviews" in out and "ratio reviews/s (b), tfm / HF" in out
    assert out.count(" steps/s  (median of 1") == 2 and out.count(" reviews/s  (median of 1") == 2


def test_bench_refuses_bad_input_in_one_line(tmp_path):
    done = run("scripts/bench.py", "train", "--config", str(tmp_path / "none.toml"), "--samples", "0")
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("bench: error: ")
    done = run("scripts/bench.py", "train", "--steps", "0")
    assert done.returncode == 2 and "at least 1" in done.stderr


def acceptable(body: bytes) -> bool:
    """What `tfm serve` accepts: a body within the limit, a JSON object whose texts are 1 to MAX_TEXTS
    non-empty strings."""
    try:
        texts = json.loads(body)["texts"]
    except (ValueError, KeyError, TypeError):
        return False
    return (len(body) <= bench.MAX_BODY and isinstance(texts, list) and 0 < len(texts) <= bench.MAX_TEXTS
            and all(isinstance(t, str) and t.strip() for t in texts))


def test_every_malformed_request_is_one_the_server_must_refuse():
    bodies = bench.malformed_requests(90, random.Random(0))
    assert len(bodies) == 90 and len(set(bodies)) == 9  # every kind, ten times
    assert not any(acceptable(b) for b in bodies)
    assert acceptable(json.dumps({"texts": ["a good film"] * bench.MAX_TEXTS}).encode())
    assert bodies == bench.malformed_requests(90, random.Random(0)) != bench.malformed_requests(90, random.Random(1))


def test_a_request_counts_as_answered_only_with_the_right_answer():
    one = json.dumps({"predictions": [{"label": "pos"}]}).encode()
    error = json.dumps({"error": "'texts' is empty"}).encode()
    assert bench.answered((0.01, 200, one), 1) and not bench.answered((0.01, 200, one), 2)
    assert bench.answered((0.01, 422, error), 0) and bench.answered((0.01, 413, error), 0)
    assert not bench.answered((0.01, 200, one), 0) and not bench.answered((0.01, 500, error), 0)
    assert not bench.answered((0.01, 400, b"Bad Request"), 0) and not bench.answered((0.01, 0, b""), 1)


@pytest.mark.slow
def test_bench_serve_load_tests_a_trained_run(trained_dir, synthetic_data_dir):
    done = run("scripts/bench.py", "serve", "-c", str(trained_dir), "--data", str(synthetic_data_dir),
               "--samples", "100", "--latency-requests", "20", "--requests", "60", "--clients", "4",
               "--malformed", "27")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "(1) one 200-word review a request, 1 client, 20 requests" in out and "p99" in out
    assert "(2) 60 requests of one review, 4 clients" in out and "ratio to tfm evaluate's reviews/s" in out
    assert "malformed without a JSON 4xx: 0" in out and "good ones failed: 0" in out
    assert "(4) SIGTERM: tfm serve exited with code 0" in out and "correctness: ok" in out


# --------------------------------------------------------------------------- reproduce_imdb.py


def test_reproduce_plans_each_recipes_tfm_commands_once_and_in_order(tmp_path):
    extra = ["train.log_every=5", "pretrain.mask_prob=0.2", 'model.pooling="mean"']
    plan = reproduce.steps(list(reproduce.RECIPES), [1, 2], "cpu", "DATA", tmp_path, extra)
    names = [target.name for target, _ in plan]
    assert names == ["default-s1", "default-s2", "seed-s1", "seed-s2", "cpu-pretrain-s1", "cpu-pretrained-s1",
                     "cpu-pretrain-s2", "cpu-pretrained-s2", "cpu-scratch-s1", "cpu-scratch-s2", "pseudo-s1.jsonl",
                     "self-trained-s1", "pseudo-s2.jsonl", "self-trained-s2"]
    cmds = {name: cmd[len(reproduce.TFM):] for name, (_, cmd) in zip(names, plan)}
    pretrain = cmds["cpu-pretrain-s2"]  # each seed's pipeline pretrains its own encoder
    assert pretrain[:3] == ["pretrain", "--config", str(CONFIGS / "cpu-pretrain.toml")]
    assert pretrain[pretrain.index("--seed") + 1] == "2" and pretrain[pretrain.index("-o") + 1].endswith("-s2")
    assert "pretrain.mask_prob=0.2" in pretrain and 'model.pooling="mean"' not in pretrain  # refused by pretrain
    for name, cmd in cmds.items():
        if cmd[0] == "train":
            seed = name.rsplit("-s", 1)[1]
            assert cmd[cmd.index("--seed") + 1] == seed and cmd[cmd.index("-o") + 1] == str(tmp_path / name)
            assert "--test" in cmd and "train.log_every=5" in cmd and "pretrain.mask_prob=0.2" not in cmd
            if "--config" in cmd:
                assert Path(cmd[cmd.index("--config") + 1]).is_file()
    assert "--config" not in cmds["default-s1"]
    assert cmds["seed-s1"][1:5] == ["--config", str(CONFIGS / "seed.toml"), "--epochs", "1"]
    encoder = str(tmp_path / "cpu-pretrain-s1")
    assert cmds["cpu-pretrained-s1"][1:5] == ["--config", str(CONFIGS / "cpu-finetune.toml"), "--init-from", encoder]
    scratch = cmds["cpu-scratch-s1"]  # the encoder's sizes, from random weights, reading as far as the fine-tuning
    assert "--init-from" not in scratch
    assert {"model.d_model=256", "model.n_layers=4", 'model.ff="geglu"', "data.vocab_size=16000"} <= set(scratch)
    assert not any(a.startswith("data.max_length") for a in scratch)
    assert cmds["pseudo-s1.jsonl"][:3] == ["pseudo-label", "-c", str(tmp_path / "cpu-pretrained-s1")]
    student = cmds["self-trained-s1"]
    assert student[1:5] == ["--config", str(CONFIGS / "self-train.toml"), "--init-from", encoder]
    assert f"data.pseudo_labels={json.dumps(str(tmp_path / 'pseudo-s1.jsonl'))}" in student


def test_reproduce_takes_the_gpu_pair_and_its_teacher_when_asked(tmp_path):
    plan = reproduce.steps(["self-trained"], [7], "cpu", "DATA", tmp_path, [])
    assert [t.name for t, _ in plan] == ["cpu-pretrain-s7", "cpu-pretrained-s7", "pseudo-s7.jsonl",
                                         "self-trained-s7"]
    plan = reproduce.steps(["pretrained", "scratch"], [7], "gpu", "DATA", tmp_path, [])
    assert [t.name for t, _ in plan] == ["gpu-pretrain-s7", "gpu-pretrained-s7", "gpu-scratch-s7"]
    assert str(CONFIGS / "gpu-pretrain.toml") in plan[0][1] and str(CONFIGS / "gpu-finetune.toml") in plan[1][1]
    assert "model.d_model=512" in plan[2][1] and "model.n_layers=8" in plan[2][1]


def test_reproduce_skips_finished_steps_and_names_a_failed_one(tmp_path):
    failing = [*reproduce.TFM[:1], "-c", "raise SystemExit(3)"]
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "metrics.json").write_text("{}")
    reproduce.run_step(tmp_path / "done", failing)  # finished: not run again
    (tmp_path / "labels.jsonl").write_text("")
    reproduce.run_step(tmp_path / "labels.jsonl", failing)
    with pytest.raises(reproduce.StepFailed) as e:
        reproduce.run_step(tmp_path / "todo", failing)
    assert e.value.code == 3


def test_reproduce_adds_up_each_attempts_wall_time_and_writes_the_pipeline(tmp_path):
    encoder, finetune = tmp_path / "cpu-pretrain-s5", tmp_path / "cpu-pretrained-s5"
    times = []
    for folder, code in ((encoder, 3), (encoder, 0), (finetune, 0)):  # the encoder fails once, then resumes
        writes = (f"import pathlib, sys, time; pathlib.Path({str(folder)!r}).mkdir(exist_ok=True); "
                  f"time.sleep(0.3 if {code} else 0); sys.exit({code})")  # the failed attempt is the long one
        with contextlib.suppress(reproduce.StepFailed):
            reproduce.run_step(folder, [*reproduce.TFM[:1], "-c", writes])
        times.append(json.loads((folder / "step.json").read_text())["wall_time_sec"])
    assert 0.3 <= times[0] < times[1]  # the second attempt's time is added to the first's
    encoder_metrics = {"train_time_sec": 50.0, "steps": 7, "stop_reason": "time_budget"}
    (encoder / "metrics.json").write_text(json.dumps(encoder_metrics))
    metrics = {"hardware": "CPU: X", "val": {"accuracy": 0.9}, "test": {"accuracy": 0.91}, "steps": 3}
    (finetune / "metrics.json").write_text(json.dumps(metrics))
    earlier = {"runs": [{"seed": 5, "cpu": "old"}, {"seed": 9, "cpu": "CPU: Y"}]}  # seed 5 is run again
    pipeline = reproduce.pipeline_runs(tmp_path, "cpu", [5], earlier)
    run, kept = pipeline["runs"]
    assert kept == earlier["runs"][1] and pipeline["cpu"] == "CPU: X; CPU: Y"
    steps = [json.loads((f / "step.json").read_text()) for f in (encoder, finetune)]
    assert run["cpu"] == "CPU: X" and run["seed"] == 5 and run["test_accuracy"] == 0.91
    assert run["wall_time_sec"] == round(times[1] + times[2], 1) and run["commands"] == [s["command"] for s in steps]
    assert run["stages"] == {"pretrain_wall_sec": round(times[1], 1), "pretrain_train_sec": 50.0, "pretrain_steps": 7,
                             "pretrain_stop": "time_budget", "finetune_wall_sec": round(times[2], 1),
                             "finetune_train_sec": None, "finetune_steps": 3, "finetune_stop": None}


def test_reproduce_refuses_self_training_on_the_gpu_pair():
    done = run("scripts/reproduce_imdb.py", "--recipes", "self-trained", "--pair", "gpu")
    assert done.returncode == 2 and "self-trained is for the cpu pair only" in done.stderr


# --------------------------------------------------------------------------- tfidf_baseline.py


def test_tfidf_baseline_fits_and_validates_on_what_tfm_train_does(synthetic_data_dir, tmp_path):
    from conftest import make_examples, write_jsonl

    from transformer_cli.config import DataConfig
    from transformer_cli.data import prepare_train_data

    splits = script("tfidf_baseline").splits
    held_out = splits(str(synthetic_data_dir), 7)  # no validation split: 10% of train held out, as tfm train does
    prepared = prepare_train_data(DataConfig(source=str(synthetic_data_dir), vocab_size=300), 7)
    assert [len(s) for s in held_out] == [len(prepared.train), len(prepared.val), 200] == [360, 40, 200]
    assert held_out[1].texts == prepared.val_texts
    data = tmp_path / "with-validation"
    data.mkdir()
    for split, n, seed in (("train", 300, 1), ("validation", 60, 2), ("test", 50, 3)):
        write_jsonl(data / f"{split}.jsonl", make_examples(n, seed=seed))
    train, val, test = splits(str(data), 7)  # tfm train trains on all of train, validates on validation
    assert (len(train), len(val), len(test)) == (300, 60, 50)
    assert val.texts == [row["text"] for row in make_examples(60, seed=2)]


def test_tfidf_baseline_scores_the_synthetic_reviews_or_says_what_it_needs(synthetic_data_dir):
    done = run("scripts/tfidf_baseline.py", "--data", str(synthetic_data_dir))
    if importlib.util.find_spec("sklearn") is None:
        assert done.returncode == 1 and "pip install scikit-learn" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        return
    assert done.returncode == 0, done.stderr[-2000:]
    scores = done.stdout.splitlines()[-1].split()  # validation (40): 0.9750   test (200): 0.9650
    assert scores[0] == "validation" and scores[3] == "test"
    assert float(scores[2]) > 0.8 and float(scores[5]) > 0.8  # a few sentiment words decide each review
