"""The scripts in scripts/, on synthetic data and tiny sizes: reproduce_imdb.py end to end with the
recipes shrunk to seconds, and the benchmarks' tables, JSON and argument errors (never their speed)."""

import importlib
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
from conftest import REPO, needs_cxx

from transformer_cli.runtime import Runtime, resolve_precision


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    """A script in a fresh process; its exit code is asserted by the caller."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)

SHRINK = ["train.max_steps=3", "data.max_length=64", "data.vocab_size=500", "train.eval_batch_size=64"]


def test_reproduce_trains_evaluates_and_tabulates_each_seed(synthetic_data_dir, tmp_path):
    cmd = [sys.executable, str(REPO / "scripts" / "reproduce_imdb.py"), "--data", str(synthetic_data_dir),
           "--out", str(tmp_path / "runs"), "--recipes", "default", "--seeds", "1", "2",
           "--results-dir", str(tmp_path / "results"), *SHRINK]
    first = run(cmd)
    assert first.returncode == 0, first.stderr[-2000:]
    rows = [line for line in first.stdout.splitlines() if line.startswith("| default |")]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "2"]
    for seed, row in zip((1, 2), rows):
        test = json.loads((tmp_path / "results" / f"default-s{seed}.json").read_text())
        assert test == json.loads((tmp_path / "runs" / f"default-s{seed}" / "test.json").read_text())
        assert test["num_examples"] == 200 and f"{test['accuracy']:.2%}" in row
    assert "default: test accuracy" in first.stdout and "over 2 seeds" in first.stdout

    assert all("train.max_steps=3" in row and "--seed" in row for row in rows)
    # Finished runs are not repeated, and their rows show the command that trained them, not this one.
    again = run([*cmd, "train.log_every=7"])
    assert again.returncode == 0 and "$ " not in again.stdout
    assert [line for line in again.stdout.splitlines() if line.startswith("| default |")] == rows
    warnings = [line for line in again.stderr.splitlines() if "was trained by another command, kept" in line]
    assert len(warnings) == 2 and "train.max_steps=3" in warnings[0] and "train.log_every=7" not in warnings[0]
    same = run(cmd)  # the same command: no warning
    assert same.returncode == 0 and "another command" not in same.stderr


def test_reproduce_names_a_failed_step_keeps_finished_runs_and_exits_with_its_code(synthetic_data_dir, tmp_path):
    data = tmp_path / "data"  # training works; evaluating the test split fails (a review without a label)
    data.mkdir()
    (data / "train.jsonl").write_text((synthetic_data_dir / "train.jsonl").read_text())
    (data / "test.jsonl").write_text('{"text": "a review without a label"}\n')
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(REPO / "scripts" / "reproduce_imdb.py"), "--data", str(data), "--out", str(runs),
           "--recipes", "default", "--seeds", "1", "--", *SHRINK]
    done = run(cmd)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("reproduce_imdb: error: `tfm evaluate -c ") and "failed with exit code 1" in last
    assert "are kept" in last
    out = runs / "default-s1"
    assert (out / "metrics.json").exists() and not (out / "test.json").exists()
    assert not (out / "test.json.tmp").exists()  # no partial file
    usage = run([*cmd[:3], str(tmp_path / "missing"), "--out", str(tmp_path / "new"), *cmd[6:]])  # tfm's 2
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    assert "`tfm train --data " in usage.stderr.strip().splitlines()[-1]


def test_ngram_ablation_scores_the_whole_model_and_each_path(synthetic_data_dir, tmp_path):
    import torch
    from conftest import one_at_a_time_logits, tiny_config

    from transformer_cli.data import prepare_train_data
    from transformer_cli.evaluate import load_model_dir
    from transformer_cli.train import train

    metrics = train(tiny_config(synthetic_data_dir, tmp_path / "run", model__ngram_buckets=256), progress=False)
    cmd = [sys.executable, str(REPO / "scripts" / "ngram_ablation.py"), str(tmp_path / "run"), "--json"]
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["model"] == metrics["val"]["accuracy"]  # the same split and model as training validated
    # Each path scored against the reference: its logits, one review at a time.
    model, cfg, _, _, _ = load_model_dir(tmp_path / "run", torch.device("cpu"))
    val = prepare_train_data(cfg.data, cfg.train.seed).val

    def accuracy(logits) -> float:
        return float((logits.argmax(-1).numpy() == val.labels).mean())

    want = {"model": accuracy(one_at_a_time_logits(model, val)),
            "ngrams_only": accuracy(one_at_a_time_logits(model.ngrams, val))}
    with torch.no_grad():
        model.ngrams.table.weight.zero_()
    want["transformer_only"] = accuracy(one_at_a_time_logits(model, val))
    assert result == want

    plain = tmp_path / "plain"
    train(tiny_config(synthetic_data_dir, plain, train__max_steps=2), progress=False)
    refused = run([*cmd[:2], str(plain)])
    assert refused.returncode == 1 and "without an n-gram path" in refused.stderr
    missing = run([*cmd[:2], str(tmp_path / "nothing")])
    assert missing.returncode == 1 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr


def test_ngram_ablation_reads_a_fine_tuned_run_with_its_encoders_tokenizer(synthetic_data_dir, tmp_path):
    from conftest import tiny_config

    from transformer_cli.pretrain import pretrain
    from transformer_cli.train import train

    pretrain(tiny_config(synthetic_data_dir, tmp_path / "pre", train__max_steps=2), progress=False)
    metrics = train(tiny_config(synthetic_data_dir, tmp_path / "run", train__init_from=str(tmp_path / "pre"),
                                model__ngram_buckets=256, train__max_steps=4), progress=False)
    done = run([sys.executable, str(REPO / "scripts" / "ngram_ablation.py"), str(tmp_path / "run"), "--json"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["model"] == metrics["val"]["accuracy"]


@pytest.mark.parametrize("script", [["calibration_check.py", "{run}"], ["faithfulness.py", "-c", "{run}"],
                                    ["loadtest_serve.py", "-c", "{run}"], ["tfidf_baseline.py", "--data", "{run}"]])
def test_scripts_refuse_a_missing_folder_in_one_line(script, tmp_path):
    """(tfidf_baseline.py says so about scikit-learn first where it is not installed)"""
    missing = str(tmp_path / "nothing")
    done = run([sys.executable, str(REPO / "scripts" / script[0]), *(a.format(run=missing) for a in script[1:])])
    name = script[0].removesuffix(".py")
    assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"{name}: error: ") and ("nothing" in line or "scikit-learn" in line)


@pytest.mark.parametrize("args", [["--fraction", "2"], ["--fraction", "0"], ["-n", "0"]])
def test_faithfulness_refuses_an_impossible_measure_before_loading(args, tmp_path):
    done = run([sys.executable, str(REPO / "scripts" / "faithfulness.py"), "-c", str(tmp_path / "nothing"), *args])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "-n must be at least 1 and --fraction in (0, 1]" in done.stderr


@pytest.mark.parametrize(("script", "code"), [
    (["bench_infer.py", "-c", "{missing}", "--skip-cold-start"], 1), (["bench_onnx.py", "-c", "{missing}"], 1),
    (["bench_train.py", "--mode", "imdb", "--data", "{missing}", "--variants", "a", "--steps", "1"], 2),
    (["bench_data.py", "--data", "{missing}"], 2),  # the error of its child process
    (["bench_pretrain.py", "--config", "{missing}.toml"], 2),
    (["bench_pretrain.py", "--mode", "synthetic", "--steps", "0"], 2), (["bench_explain.py", "--repeats", "0"], 2),
    (["bench_infer.py", "-c", "{missing}", "--compare-tokens-per-thread", "1k"], 2),  # before the measurements
    (["bench_infer.py", "-c", "{missing}", "--compare-tokens-per-thread", "0,-5"], 2),
    (["bench_data.py", "--data", "{missing}", "--cached-runs", "2"], 2),  # the median of two is no run: said first
    (["bench_threads.py", "--steps", "0"], 2), (["bench_threads.py", "--config", "{missing}.toml"], 2),
    (["bench_threads.py", "--data", "{missing}", "--steps", "1", "--rounds", "1"], 2)])  # its first child's error
def test_benchmarks_refuse_bad_input_in_one_line(script, code, tmp_path):
    missing = str(tmp_path / "nothing")
    done = run([sys.executable, str(REPO / "scripts" / "bench" / script[0]),
                *(a.format(missing=missing) for a in script[1:])])
    assert done.returncode == code and "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]  # (a usage error prints the usage first, as argparse does)
    assert last.startswith((script[0].removesuffix(".py") + ": error: ", f"{script[0]}: error: "))
    assert "nothing" in last or "must be" in last or "give whole numbers" in last
    if "--cached-runs" in script:
        assert "--cached-runs must be an odd number" in last


@pytest.mark.parametrize(("script", "args"), [
    ("bench_data", []), ("bench_infer", ["-c", "run"]), ("bench_onnx", ["-c", "run"]), ("bench_pretrain", []),
    ("bench_train", []), ("bench_threads", []), ("loadtest_serve", ["-c", "run"])])
def test_script_defaults_name_the_checkouts_files_from_any_folder(script, args, tmp_path, monkeypatch):
    """Default paths resolve against the repository; a path the user gives stays relative to the working folder."""
    from transformer_cli.config import load_config

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))
    monkeypatch.chdir(tmp_path)
    parse_args = importlib.import_module(script).parse_args
    defaults = parse_args(args)
    assert defaults.data == str(REPO.parent / "shared" / "data" / "imdb")
    assert parse_args([*args, "--data", "reviews"]).data == "reviews"
    if script == "bench_pretrain":
        assert load_config(defaults.config).pretrain.objective  # configs/pretrain.toml, read from tmp_path
        assert parse_args(["--config", "mine.toml"]).config == "mine.toml"


def test_bench_data_reads_relative_paths_from_the_working_folder(synthetic_data_dir, tmp_path):
    """Its timed child processes run in the folder the script was started from, not in the repository."""
    out = tmp_path / "data.json"
    config = tmp_path / "data.toml"
    config.write_text("[data]\nvocab_size = 300\nmax_length = 32\n")
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_data.py"), "--data",
           os.path.relpath(synthetic_data_dir, tmp_path), "--config", config.name, "--max-samples", "40",
           "--json", out.name]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["cold"]["data_config"]["source"] == str(synthetic_data_dir.resolve())
    assert result["cold"]["data_config"]["vocab_size"] == 300


def test_tfidf_baseline_fits_and_validates_on_what_tfm_train_does(synthetic_data_dir, tmp_path, monkeypatch):
    from conftest import make_examples, write_jsonl

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from tfidf_baseline import splits  # (the fit itself needs scikit-learn, which tfm does not)

    from transformer_cli.config import DataConfig
    from transformer_cli.data import prepare_train_data

    held_out = splits(str(synthetic_data_dir), 7, 1)  # no validation split: 10% of train held out, as tfm train does
    prepared = prepare_train_data(DataConfig(source=str(synthetic_data_dir), vocab_size=300), 7)
    assert [len(s) for s in held_out] == [len(prepared.train), len(prepared.val), 200] == [360, 40, 200]
    data = tmp_path / "with-validation"
    data.mkdir()
    for split, n, seed in (("train", 300, 1), ("validation", 60, 2), ("test", 50, 3)):
        write_jsonl(data / f"{split}.jsonl", make_examples(n, seed=seed))
    train, val, test = splits(str(data), 7, 1)  # tfm train trains on all of train, validates on validation
    assert (len(train), len(val), len(test)) == (300, 60, 50)
    assert val.texts == [row["text"] for row in make_examples(60, seed=2)]


def test_calibration_check_saves_nothing_when_it_fails(trained_dir, synthetic_data_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(trained_dir, model)
    config = model / "config.json"
    meta = json.loads(config.read_text())
    meta.pop("calibration", None)  # a model trained without train.calibrate
    config.write_text(json.dumps(meta))
    before = config.read_bytes()
    cmd = [sys.executable, str(REPO / "scripts" / "calibration_check.py"), str(model), "--save"]
    bad = run([*cmd, "--split", "nosuchsplit"])  # the validation split is scored, then this one fails
    assert bad.returncode == 2 and "no 'nosuchsplit' split" in bad.stderr
    assert config.read_bytes() == before
    done = run([*cmd, "--split", "test"])
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert json.loads(config.read_text())["calibration"] == result["validation"]


def test_screenshot_replaces_an_image_only_with_the_one_the_browser_wrote(tmp_path):
    import os

    bin_dir, page, png = tmp_path / "bin", tmp_path / "page.html", tmp_path / "docs" / "page.png"
    bin_dir.mkdir()
    page.write_text("<html><body>a review</body></html>")
    png.parent.mkdir()
    png.write_bytes(b"the image from before")
    browser = bin_dir / "chromium"  # found first on PATH: a stand-in that writes what it is told to
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def screenshot(script: str) -> subprocess.CompletedProcess:
        browser.write_text("#!/bin/sh\n" + script)
        browser.chmod(0o755)
        cmd = [sys.executable, str(REPO / "scripts" / "screenshot.py"), str(page), str(png)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, env=env)

    silent = screenshot("exit 0\n")  # exits without an error, writes nothing
    assert silent.returncode == 1 and silent.stderr.strip() == f"screenshot: error: chromium wrote no image to '{png}'"
    failed = screenshot("echo 'no display' >&2; exit 3\n")
    assert failed.returncode == 1 and failed.stderr.strip() == "screenshot: error: chromium exited with 3: no display"
    assert png.read_bytes() == b"the image from before" and os.listdir(png.parent) == ["page.png"]
    done = screenshot('for a; do case "$a" in --screenshot=*) printf new > "${a#--screenshot=}";; esac; done\n')
    assert done.returncode == 0 and png.read_bytes() == b"new" and os.listdir(png.parent) == ["page.png"]


def test_bench_train_times_each_variant_on_the_same_batches(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))
    from _bench_common import forward_flops
    from bench_train import parse_args

    assert parse_args([]).variants[:3] == ["a", "b", "c"]
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_train.py"), "--mode", "synthetic", "--d-model", "16",
           "--heads", "2", "--layers", "1", "--seq-len", "256", "--vocab", "100", "--batch-size", "4", "--steps", "2",
           "--warmup", "1", "--threads", "1", "--variants", "a,a_ngrams_lazy,a_foreach,a_h1,a_fp32,b",
           "--json", str(out)]
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    mode = json.loads(out.read_text())["modes"]["synthetic"]
    rows = mode["rows"]
    assert [r["variant"] for r in rows] == ["(a) ours", "(a) ours + n-gram path, lazy embeddings",
                                            "(a) ours, foreach AdamW", "(a) ours, 1 head", "(a) ours, fp32",
                                            "(b) naive former-style"]
    assert [r["heads"] for r in rows] == [2, 2, 2, 1, 2, 2]
    auto = Runtime(torch.device("cpu"), resolve_precision("auto", torch.device("cpu"))).precision  # as tfm train
    assert [r["precision"] for r in rows] == [auto] * 4 + ["fp32", "fp32"]
    # the default's word dropout (0.5) keeps about 128 of 256 tokens: (a) runs the columns `compact`
    # leaves, (b) all 256, and each row's FLOPs are those of the columns it ran
    widths = [r["width"] for r in rows]
    assert all(w < 256 for w in widths[:5]) and widths[5] == 256
    assert rows[0]["flops"] == pytest.approx(3 * 2 * forward_flops(16, 1, 4, 4, widths[0]))
    assert rows[-1]["flops"] == mode["flops"] == pytest.approx(3 * 2 * forward_flops(16, 1, 4, 4, 256))
    peaks = mode["matmul_peaks"]  # each row's % peak is of the matmul peak in its own precision
    assert set(peaks) == {"fp32", auto} and {p["dtype"] for p in peaks.values()} == {f"torch.{d}" for d in (
        "float32", "bfloat16" if auto == "bf16" else "float32")}
    for r in rows:
        assert r["pct_peak"] == pytest.approx(100 * r["gflops"] / peaks[r["precision"]]["gflops"])
    assert not any(r["note"] for r in rows)  # a note means a non-finite loss
    assert all(r["vs_b"] == pytest.approx(r["samples_per_sec"] / rows[-1]["samples_per_sec"]) for r in rows)
    bad = run([*cmd[:-4], "--variants", "a_turbo"])
    assert bad.returncode == 2 and "unknown variant(s) ['a_turbo']" in bad.stderr
    both = run([*cmd[:-4], "--variants", "a_bf16_fp32"])
    assert both.returncode == 2 and "unknown variant(s) ['a_bf16_fp32']" in both.stderr
    odd = run([*cmd[:-4], "--variants", "a_h3"])
    assert odd.returncode == 2 and "must be divisible by every head count, [2, 3]" in odd.stderr


def test_bench_train_profiles_where_a_step_went(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))
    from _bench_common import op_group
    from bench_train import main

    assert [op_group(n) for n in ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::bmm",
                                  "aten::_softmax_backward_data", "aten::_log_softmax", "aten::addmm", "aten::baddbmm",
                                  "aten::_to_copy", "aten::_fused_adamw_", "aten::gelu")] == [
        "attention kernels", "attention kernels", "attention kernels", "other", "linear-layer matmuls", "other",
        "casts and copies", "optimizer", "other"]
    out = tmp_path / "bench.json"
    main(["--mode", "synthetic", "--d-model", "16", "--heads", "2", "--layers", "1", "--seq-len", "16", "--vocab",
          "100", "--batch-size", "4", "--steps", "2", "--warmup", "1", "--variants", "a,b,a_explicit",
          "--profile", "b,a", "--json", str(out)])
    rows = json.loads(out.read_text())["modes"]["synthetic"]["rows"]
    assert [("profile" in r) for r in rows] == [True, True, False]  # only the variants asked for
    for r in rows[:2]:
        p = r["profile"]
        assert list(p["groups_pct"]) == ["attention kernels", "linear-layer matmuls", "casts and copies", "optimizer",
                                         "other"]
        assert sum(p["groups_pct"].values()) == pytest.approx(100) and p["groups_pct"]["attention kernels"] > 0
        assert p["groups_pct"]["linear-layer matmuls"] > 0 and p["self_cpu_ms_per_step"] > 0
        assert len(p["top"]) == 8 and [t["pct"] for t in p["top"]] == sorted((t["pct"] for t in p["top"]), reverse=True)
    printed = capsys.readouterr().out
    assert "profile (a) ours: share of self CPU time" in printed and "profile (b) naive former-style" in printed
    with pytest.raises(SystemExit) as bad:
        main(["--mode", "synthetic", "--variants", "a", "--profile", "b"])
    assert bad.value.code == 2 and "--profile ['b']: not among --variants ['a']" in capsys.readouterr().err


def test_bench_attention_times_both_kernels_and_checks_they_agree(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))
    from bench_attention import main

    from transformer_cli import kernels

    out = tmp_path / "attn.json"
    main(["--shapes", "3,2,16,8;2,1,9,4;2,2,20,16", "--pad-fraction", "0.5", "--repeats", "2", "--bf16", "--json",
          str(out)])
    result = json.loads(out.read_text())
    assert [s["shape"] for s in result["shapes"]] == [[3, 2, 16, 8], [2, 1, 9, 4], [2, 2, 20, 16]]
    for shape in result["shapes"]:
        B, H, T, Dh = shape["shape"]
        assert shape["max_abs_diff"]["fp32"] < 1e-5 and shape["max_abs_diff"]["bf16"] < 5e-2  # the same attention
        rows = shape["rows"]
        with_kernel = Dh == 16 and kernels.available()  # transformer_cli.kernels: head sizes 16, 32, 64
        assert [(r["precision"], r["kernel"], r["pass"]) for r in rows] == [
            (p, k, s) for p in ("fp32", "bf16") for k in ("fused", "explicit") for s in ("forward", "forward+backward")
        ] + [("bf16", "kernel", "forward")] * with_kernel
        if with_kernel:
            assert shape["max_abs_diff"]["kernel"] < 5e-2
        peaks = shape["matmul_peaks"]  # each shape's, timed between its rounds
        for r in rows:
            flops = (4 if r["pass"] == "forward" else 12) * B * H * T * T * Dh
            assert r["gflops"] == pytest.approx(flops / (r["ms"] / 1e3) / 1e9)
            assert r["pct_peak"] == pytest.approx(100 * r["gflops"] / peaks[r["precision"]]["gflops"])
        fp32 = {(r["kernel"], r["pass"]): r["ms"] for r in rows[:4]}
        fp32["kernel", "forward"] = fp32["fused", "forward"]  # the kernel against what runs without it
        assert all(r["vs_fp32"] == pytest.approx(r["ms"] / fp32[(r["kernel"], r["pass"])]) for r in rows)
    assert "one doing only its matmuls at the peak would be" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main(["--shapes", "3,2,16"])
    assert bad.value.code == 2 and "each shape is four positive integers" in capsys.readouterr().err


def test_bench_infer_compares_cpu_batching_settings(trained_dir, synthetic_data_dir, tmp_path):
    from transformer_cli.runtime import cpu_has_fast_bf16

    out = tmp_path / "infer.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_infer.py"), "-c", str(trained_dir), "--data",
           str(synthetic_data_dir), "--threads", "2", "--skip-cold-start", "--compare-workers", "--compare-precision",
           "--compare-tokens-per-thread", "0,4096,64", "--compare-samples", "120", "--compare-rounds", "1",
           "--profile", "--json", str(out)]
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads(out.read_text())["throughput"]
    assert result["precision"] == "fp32"  # as tfm evaluate reads a run trained in fp32
    rows = result["compare"]
    bf16 = ["<= 4096 tokens/thread, 2 worker(s) of 1 thread(s), bf16"] if cpu_has_fast_bf16() else []
    assert [r["setting"] for r in rows] == [
        "default: <= 4096 tokens/thread, 2 worker(s) of 1 thread(s), fp32",  # 4096 is the default: not repeated
        "batches of batch_size reviews, 2 worker(s) of 1 thread(s), fp32",
        "<= 64 tokens/thread, 2 worker(s) of 1 thread(s), fp32",
        "<= 4096 tokens/thread, 1 worker(s) of 2 thread(s), fp32",
        *bf16,
    ]
    for row in rows[:4]:  # every fp32 setting computes the same predictions; only the speed may differ
        assert row["accuracy"] == rows[0]["accuracy"] and row["loss"] == pytest.approx(rows[0]["loss"], abs=1e-6)
    for row in rows:
        assert row["reviews_per_sec"] == pytest.approx(120 / row["median_sec"])
    if bf16:  # bf16 computes them within its precision
        assert rows[-1]["loss"] != rows[0]["loss"] and rows[-1]["loss"] == pytest.approx(rows[0]["loss"], rel=2e-2, abs=1e-4)
    assert "% padding, <= 4096 tokens/thread, 2 worker(s) of 1 thread(s), fp32; load" in done.stdout
    profile = result["profile"]  # of evaluate_model on the 120 reviews: the workers' ops are seen
    assert sum(profile["groups_pct"].values()) == pytest.approx(100)
    assert profile["groups_pct"]["attention kernels"] > 0 and profile["groups_pct"]["linear-layer matmuls"] > 0
    assert "profile evaluate_model, 120 reviews: share of self CPU time" in done.stdout


@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="the attention kernel needs AVX-512 BF16")
def test_bench_infer_compares_the_attention_kernel_with_sdpa(trained_dir, synthetic_data_dir, tmp_path):
    out = tmp_path / "infer.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_infer.py"), "-c", str(trained_dir), "--data",
           str(synthetic_data_dir), "--threads", "2", "--skip-cold-start", "--precision", "bf16",
           "--compare-attention", "--compare-samples", "80", "--compare-rounds", "1", "--json", str(out)]
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads(out.read_text())["throughput"]
    rows = result["compare"]
    assert [r["setting"] for r in rows] == [
        "default: <= 4096 tokens/thread, 2 worker(s) of 1 thread(s), bf16",
        "<= 4096 tokens/thread, 2 worker(s) of 1 thread(s), bf16 attention kernel off, bf16",
    ]
    assert rows[1]["loss"] != rows[0]["loss"]  # another kernel ran ...
    assert rows[1]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-2)  # ... on the same attention


def test_bench_onnx_times_every_eager_path_beside_onnxruntime(trained_dir, synthetic_data_dir, tmp_path):
    out = tmp_path / "onnx.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_onnx.py"), "-c", str(trained_dir), "--data",
           str(synthetic_data_dir), "--texts", "40", "--repeats", "1", "--json", str(out)]
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    (result,) = report["models"]
    rows = {r["path"]: r for r in result["rows"]}
    bf16 = ["eager bf16 (kernel)", "eager bf16, kernel off"] if report["kernel"].startswith("available") else []
    assert list(rows) == ["eager fp32", *bf16, "onnxruntime fp32"]  # the run trained in fp32: eager's is fp32
    assert rows["eager fp32"]["ratio"] == 1.0 and rows["eager fp32"]["max_abs_logit_diff"] == 0.0
    assert rows["onnxruntime fp32"]["max_abs_logit_diff"] < 1e-4  # the same model in another runtime
    for path in bf16:  # bf16 rounds, within its precision
        assert 0 < rows[path]["max_abs_logit_diff"] < 0.1
    for path, r in rows.items():  # one round: its time is the median
        assert r["reviews_per_sec"] == pytest.approx(40 / result["sec_all"][path][0])


@needs_cxx
def test_bench_infer_times_evaluation_and_compares_the_compiled_model(trained_dir, synthetic_data_dir, tmp_path):
    out = tmp_path / "infer.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_infer.py"), "-c", str(trained_dir), "--data",
           str(synthetic_data_dir), "--split", "test", "--threads", "1", "--skip-cold-start", "--compile",
           "--json", str(out)]
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads(out.read_text())["throughput"]
    assert result["reviews"] == 200 and result["accuracy"] > 0.5  # the trained tiny model, on the synthetic test split
    compiled = result["compile"]
    assert compiled["same_label"] == 1.0 and compiled["max_abs_logit_diff"] < 1e-4
    assert compiled["vs_eager"] == pytest.approx(compiled["eager_sec"] / compiled["compiled_sec"])


def test_bench_infer_cold_start_predicts_a_long_review_as_encoded_whole(trained_dir, tmp_path, monkeypatch):
    out = tmp_path / "infer.json"  # -c relative to the folder it runs in, not to the repository
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_infer.py"), "-c", os.path.relpath(trained_dir, tmp_path),
           "--skip-throughput", "--runs", "1", "--long-review-mb", "0.3", "--json", str(out)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    cold = json.loads(out.read_text())["cold_start"]
    rows = {r["command"]: r for r in cold["rows"]}
    short, long = rows["tfm predict -c MODEL TEXT"], rows["tfm predict -c MODEL --file LONG (0.3 MB)"]
    assert len(rows) == 5 and short["vs_predict_text"] == 1.0
    assert long["vs_predict_text"] == pytest.approx(long["median_sec"] / short["median_sec"])
    assert 50 < short["peak_rss_mb"] < 5000 and 50 < long["peak_rss_mb"] < 5000

    # What it printed is the reference's: the review encoded whole, not from its two ends.
    from transformer_cli import data as data_mod
    from transformer_cli.evaluate import predict_texts

    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))
    from bench_infer import long_review

    text = long_review(tmp_path / "long.txt", 0.3).read_text(encoding="utf-8").rstrip("\n")
    monkeypatch.setattr(data_mod, "LONG_TEXT_CHARS", len(text))
    (r,) = predict_texts(trained_dir, [text], device="cpu")
    assert cold["printed"][long["command"]].split("\t")[:2] == [r["label"], f"{r['score']:.4f}"]


def test_bench_scripts_import_the_transformer_cli_beside_them(tmp_path):
    """A bench script run from another checkout times that checkout's package in process, not the
    copy that happens to be installed."""
    bench = tmp_path / "checkout" / "scripts" / "bench"
    bench.mkdir(parents=True)
    (bench / "_bench_common.py").write_text((REPO / "scripts" / "bench" / "_bench_common.py").read_text())
    (tmp_path / "checkout" / "transformer_cli").mkdir()
    (tmp_path / "checkout" / "transformer_cli" / "__init__.py").write_text("WHERE = 'the other checkout'\n")
    script = bench / "bench_where.py"
    script.write_text("import _bench_common\nimport transformer_cli\nprint(transformer_cli.WHERE)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == "the other checkout"


def test_bench_infer_cold_start_times_the_checkouts_tfm(tmp_path, monkeypatch):
    """tfm is timed as `python -m transformer_cli` with this checkout first on PYTHONPATH, never through
    an installed `tfm` script, which may import another copy of transformer_cli."""
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "bench"))
    import _bench_common as bc
    import bench_infer

    ran = []

    def run_timed(cmd, env=None, cwd=bc.REPO):
        ran.append(list(cmd))
        return 0.1, subprocess.CompletedProcess(cmd, 0, stdout="pos\t0.9000\n", stderr="VmHWM_MB=100\n")

    monkeypatch.setattr(bc, "run_timed", run_timed)
    bench_infer.cold_start(tmp_path / "run", bench_infer.parse_args(["-c", "run", "--runs", "1", "--long-review-mb", "0"]),
                           tmp_path)
    tfm = [cmd for cmd in ran if cmd[1] != "-c"]
    assert len(tfm) == 2 * 2 and all(cmd[:3] == [sys.executable, "-m", "transformer_cli"] for cmd in tfm)
    imported = subprocess.run([sys.executable, "-c", "import transformer_cli; print(transformer_cli.__file__)"],
                              cwd=tmp_path, env=bc.child_env(), capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == str(REPO / "transformer_cli" / "__init__.py")


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_bench_pretrain_times_tfm_pretrains_step_beside_the_straightforward_one(pos_emb, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_pretrain.py"), "--mode", "synthetic",
           "--config", str(REPO / "configs" / "tiny.toml"), "--steps", "2", "--warmup", "1", "--threads", "1",
           "--json", str(out), f"model.pos_emb={pos_emb}"]  # precision auto: bf16 where the CPU has it, else fp32
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    amp = result["precision"] != "fp32"  # then the straightforward step in that precision too
    rope = {"rope_fp32", "learned"} if pos_emb == "rope" else set()  # the rotation's cost: fp32, and none at all
    assert set(rows) == {"tfm", "straight", "electra", "skipgram"} | ({"straight_amp"} if amp else set()) | rope
    assert rows["straight"]["vs_straight"] == 1.0
    for name in rows.keys() - {"straight"}:
        assert rows[name]["vs_straight"] == pytest.approx(rows[name]["tokens_per_sec"] / rows["straight"]["tokens_per_sec"])
    for r in rows.values():  # each row's share of the peak measured in the same run
        assert r["pct_peak"] == pytest.approx(100 * r["gflops"] / result["peak"]["gflops"])
        assert len(r["ms_steps"]) == 2 and r["ms_step"] == pytest.approx(statistics.median(r["ms_steps"]), abs=1e-3)
    # the straightforward steps compute tfm's objective: the same loss on the same first batch
    assert result["first_loss"].keys() == rows.keys() - {"electra", "skipgram", "learned"}
    for loss in result["first_loss"].values():
        assert loss == pytest.approx(result["first_loss"]["tfm"], rel=result["loss_tolerance"])
    if not amp:
        assert "amp_peak" not in result and all("pct_amp_peak" not in r for r in rows.values())
    else:  # and, for the steps under autocast, of the peak of matmuls in its precision
        assert result["amp_peak"]["dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[result["precision"]]
        assert rows["straight"]["pct_amp_peak"] is None  # fp32 on a CPU
        for r in (rows[name] for name in rows.keys() - {"straight"}):
            assert r["pct_amp_peak"] == pytest.approx(100 * r["gflops"] / result["amp_peak"]["gflops"])
    # the straightforward step scores every position, so it does more FLOPs than tfm's for the same tokens
    assert rows["straight"]["gflops"] * rows["tfm"]["tokens_per_sec"] > rows["tfm"]["gflops"] * rows["straight"]["tokens_per_sec"]


def test_reproduce_pretrains_once_fine_tunes_self_trains_and_runs_the_ablation(unlabelled_data_dir, tmp_path):
    """One pretraining serves the pretrained run, which is also the self-trained student's teacher, and
    the ablation has the same sizes from random init."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(REPO / "scripts" / "reproduce_imdb.py"), "--data", str(unlabelled_data_dir),
           "--out", str(runs), "--recipes", "pretrained", "self-trained", "scratch", "--seeds", "1", "--",
           *SHRINK, "pretrain.val_texts=40", "model.n_layers=1", "data.max_eval_samples=1000"]
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    # pretrain (without data.max_eval_samples, which it refuses); train and evaluate for each recipe; the
    # teacher's pseudo-labels once
    assert done.stdout.count("$ ") == 8
    lines = done.stdout.splitlines()
    assert [line.split("|")[1].strip() for line in lines if line.startswith("| ")][1:] == [
        "pretrain encoder", "pretrained", "self-trained", "scratch"]
    tuned, student, scratch = (json.loads((runs / f"{name}-s1" / "config.json").read_text())
                               for name in ("pretrained", "self-trained", "scratch"))
    assert tuned["train"]["init_from"] == student["train"]["init_from"] == str((runs / "pretrain").resolve())
    assert scratch["train"]["init_from"] is None
    assert tuned["data"]["max_eval_samples"] == student["data"]["max_eval_samples"] == 1000
    for section, key in [("model", "d_model"), ("model", "n_heads"), ("data", "vocab_size"), ("data", "max_length")]:
        assert tuned[section][key] == scratch[section][key], key  # the same sizes, from random init
    labels = [json.loads(line) for line in (runs / "pseudo-pretrained-s1.jsonl").read_text().splitlines()]
    assert len(labels) == 60 and {row["label"] for row in labels} <= {"neg", "pos"}
    assert student["data"]["pseudo_labels"] == str(runs / "pseudo-pretrained-s1.jsonl")
    assert student["data"]["pseudo_min_score"] == 0.9


def test_reproduce_fine_tunes_the_default_recipe_from_word_vectors(unlabelled_data_dir, tmp_path):
    """"word-vectors": configs/word-vectors.toml pretrains the token embedding once, and the default
    recipe starts from it."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(REPO / "scripts" / "reproduce_imdb.py"), "--data", str(unlabelled_data_dir),
           "--out", str(runs), "--recipes", "word-vectors", "--seeds", "1", "--", *SHRINK, "pretrain.val_texts=40",
           "train.batch_size=16"]
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip() for row in rows] == ["word-vectors encoder", "word-vectors"]
    assert "held-out skip-gram accuracy" in rows[0] and "configs/word-vectors.toml" in rows[0]
    encoder = json.loads((runs / "word-vectors" / "config.json").read_text())
    tuned = json.loads((runs / "word-vectors-s1" / "config.json").read_text())
    assert encoder["pretrain"]["objective"] == "skipgram"
    assert tuned["train"]["init_from"] == str((runs / "word-vectors").resolve())
    assert tuned["model"]["pooling"] == "max" and tuned["train"]["epochs"] == 3  # the default recipe's


def test_reproduce_teaches_the_transformer_alone_with_the_wide_and_deep_runs_labels(unlabelled_data_dir, tmp_path):
    """"taught": the wide-and-deep run of the seed labels the unlabelled reviews, and the default
    recipe (no n-gram path, no encoder) trains on train and all of those labels."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(REPO / "scripts" / "reproduce_imdb.py"), "--data", str(unlabelled_data_dir),
           "--out", str(runs), "--recipes", "taught", "--seeds", "1", "--", *SHRINK, "train.max_steps=8"]
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ")][1:] == ["taught"]
    teacher, student = (json.loads((runs / f"{name}-s1" / "config.json").read_text())
                        for name in ("wide-and-deep", "taught"))
    assert teacher["model"]["ngram_buckets"] > 0 and student["model"]["ngram_buckets"] == 0
    assert student["train"]["init_from"] is None and student["train"]["seed"] == teacher["train"]["seed"] == 1
    labels = [json.loads(line) for line in (runs / "pseudo-wide-and-deep-s1.jsonl").read_text().splitlines()]
    assert len(labels) == 60 and {row["label"] for row in labels} <= {"neg", "pos"}
    assert student["data"]["pseudo_labels"] == str(runs / "pseudo-wide-and-deep-s1.jsonl")
    assert student["data"]["pseudo_min_score"] == 0.0

    # The teacher trained again (its weights newer than its labels): the reviews are labelled again, and the
    # kept student, trained on the old labels, is named in a warning.
    later = (runs / "pseudo-wide-and-deep-s1.jsonl").stat().st_mtime + 10
    os.utime(runs / "wide-and-deep-s1" / "model.safetensors", (later, later))
    again = run(cmd)
    assert again.returncode == 0, again.stderr[-2000:]
    steps = [line for line in again.stdout.splitlines() if line.startswith("$ ")]
    assert len(steps) == 1 and " pseudo-label " in steps[0]
    assert f"{runs / 'taught-s1'} was trained before {runs / 'pseudo-wide-and-deep-s1.jsonl'} was written again" in (
        again.stderr)


@pytest.mark.parametrize(("pair", "length"), [("long", ["data.max_length=512"]), ("2h", [])])
def test_the_ablation_reads_as_far_as_the_fine_tuning_does(tmp_path, pair, length, monkeypatch):
    """"scratch" takes the encoder's sizes, but not a setting the fine-tuning recipe gives itself: over
    rotary positions finetune-2h.toml reads 1,024 tokens where pretrain-2h.toml says 512."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    args = importlib.import_module("reproduce_imdb").config_args("scratch", 1, tmp_path, pair)
    assert args[:2] == ["--config", str(REPO / "configs" / f"finetune-{pair}.toml")]
    assert "model.d_model=256" in args and "model.n_layers=4" in args  # the encoder's sizes
    assert [a for a in args if a.startswith("data.max_length=")] == length


@pytest.mark.parametrize("pair", ["gpu", "long", "2h"])
def test_reproduce_runs_another_pair_for_the_pretrained_pipeline_and_its_ablation(unlabelled_data_dir, tmp_path, pair):
    """--pair gpu (long, 2h): configs/pretrain-gpu.toml (pretrain-long.toml, pretrain-2h.toml) pretrains,
    configs/finetune-gpu.toml (finetune-long.toml, finetune-2h.toml) fine-tunes both the encoder and its random-init
    ablation (shrunk here by overrides, which come after the recipes). --pretrain-steps cuts the pretraining alone."""
    runs = tmp_path / "runs"
    steps = {"gpu": [], "long": ["--pretrain-steps", "5"], "2h": ["--pretrain-steps", "5"]}[pair]
    cut = ["data.train_max_length=32"] if pair == "2h" else []  # finetune-2h.toml's 512 is over SHRINK's max_length
    cmd = [sys.executable, str(REPO / "scripts" / "reproduce_imdb.py"), "--data", str(unlabelled_data_dir),
           "--out", str(runs), "--recipes", "pretrained", "scratch", "--seeds", "1", "--pair", pair, *steps, "--",
           *SHRINK, *cut, "pretrain.val_texts=40", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
           "train.batch_size=16"]
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-2000:]
    pretrain = json.loads((runs / "pretrain" / "config.json").read_text())
    tuned, scratch = (json.loads((runs / f"{name}-s1" / "config.json").read_text()) for name in ("pretrained", "scratch"))
    assert pretrain["pretrain"]["window"] == 128  # the pretraining recipe's
    lr, layer_lr_decay = {"gpu": (1e-4, 1.0), "long": (2e-4, 0.8), "2h": (2e-4, 0.8)}[pair]  # finetune-{pair}.toml's
    assert tuned["train"]["lr"] == scratch["train"]["lr"] == lr
    assert tuned["train"]["layer_lr_decay"] == scratch["train"]["layer_lr_decay"] == layer_lr_decay
    assert tuned["train"]["init_from"] == str((runs / "pretrain").resolve()) and scratch["train"]["init_from"] is None
    for section, key in [("model", "d_model"), ("model", "n_heads"), ("model", "n_layers"), ("model", "pos_emb"),
                         ("model", "ff"), ("data", "vocab_size")]:
        assert tuned[section][key] == scratch[section][key], key  # the same sizes, from random init
    assert f"configs/pretrain-{pair}.toml" in (runs / "pretrain" / "command.txt").read_text()
    assert f"configs/finetune-{pair}.toml" in (runs / "pretrained-s1" / "command.txt").read_text()
    assert scratch["model"]["pos_emb"] == ("rope" if pair == "2h" else "learned")
    assert scratch["model"]["ff"] == ("geglu" if pair == "2h" else "gelu")
    assert tuned["data"]["train_max_length"] == scratch["data"]["train_max_length"] == (32 if pair == "2h" else None)
    # train.max_steps=3 for every run; --pretrain-steps beats it for the pretraining alone
    assert json.loads((runs / "pretrain" / "metrics.json").read_text())["steps"] == {"gpu": 3, "long": 5, "2h": 5}[pair]
    assert json.loads((runs / "pretrained-s1" / "metrics.json").read_text())["steps"] == 3


@pytest.mark.parametrize("pair", ["gpu", "long"])
def test_reproduce_refuses_another_pair_for_self_training(tmp_path, pair):
    done = run([sys.executable, str(REPO / "scripts" / "reproduce_imdb.py"), "--out", str(tmp_path),
                "--recipes", "self-trained", "--pair", pair])
    assert done.returncode == 2 and "for the cpu pair only" in done.stderr
    assert not tmp_path.joinpath("pretrain").exists()


def test_reproduce_refuses_a_pretraining_of_no_steps(tmp_path):
    done = run([sys.executable, str(REPO / "scripts" / "reproduce_imdb.py"), "--out", str(tmp_path),
                "--recipes", "pretrained", "--pair", "long", "--pretrain-steps", "0"])
    assert done.returncode == 2 and "--pretrain-steps 0: must be 1 or more" in done.stderr
    assert not tmp_path.joinpath("pretrain").exists()


def test_calibration_check_reads_labels_as_the_models_classes(model_dir, synthetic_data_dir, tmp_path, monkeypatch,
                                                              capsys):
    """On a test split of one class, the script's accuracy and NLL are `tfm evaluate`'s: the split's labels
    are numbered by the model's classes, not by the few the split holds."""
    import shutil

    from conftest import read_jsonl, write_jsonl

    from transformer_cli.evaluate import evaluate_checkpoint

    data = tmp_path / "data"
    data.mkdir()
    shutil.copyfile(synthetic_data_dir / "train.jsonl", data / "train.jsonl")
    write_jsonl(data / "test.jsonl", [r for r in read_jsonl(synthetic_data_dir / "test.jsonl") if r["label"] == 1])
    meta = json.loads((model_dir / "config.json").read_text())
    meta["data"]["source"] = str(data)
    (model_dir / "config.json").write_text(json.dumps(meta))
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from calibration_check import main

    monkeypatch.setattr(sys, "argv", ["calibration_check.py", str(model_dir)])
    main()
    out = json.loads(capsys.readouterr().out)
    expected = evaluate_checkpoint(model_dir, device="cpu")
    assert out["num_examples"] == expected["num_examples"] == 100
    assert out["test_accuracy"] == pytest.approx(expected["accuracy"]) and expected["accuracy"] > 0.5
    assert out["test_nll_after"] == pytest.approx(expected["loss"], abs=1e-6)


def test_bench_threads_times_each_spin_count_alone_and_in_pairs(synthetic_data_dir, tmp_path):
    out = tmp_path / "threads.json"
    done = run([sys.executable, str(REPO / "scripts" / "bench" / "bench_threads.py"), "--config",
                str(REPO / "configs" / "tiny.toml"), "--data", str(synthetic_data_dir), "--steps", "2", "--rounds", "1",
                "--json", str(out)])
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["setting"] for r in result["rows"]] == ["libgomp", "tfm"]
    assert {k: len(v) for k, v in result["runs_alone"].items()} == {"libgomp": 1, "tfm": 1}
    assert {k: len(v) for k, v in result["runs_pair"].items()} == {"libgomp": 2, "tfm": 2}
    base, ours = result["rows"]
    assert all(s > 0 for r in result["rows"] for s in (r["alone_s"], r["pair_s"]))
    assert result["alone_tfm_over_libgomp"] == pytest.approx(ours["alone_s"] / base["alone_s"])
    assert result["pair_tfm_over_libgomp"] == pytest.approx(ours["pair_s"] / base["pair_s"])
    assert "tfm / libgomp: alone" in done.stdout
