import codecs
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONFIGS, REPO, write_jsonl
from typer.testing import CliRunner

from transformer_cli.cli import app

runner = CliRunner()  # click >= 8.2 keeps result.stdout and result.stderr apart

POSITIVE_TEXT = "Great wonderful film, I loved it. Superb!"
NEGATIVE_TEXT = "An awful, boring movie. I hated it, terrible."


def tfm(*args, input: str | bytes | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def python(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True, cwd=REPO,
                          timeout=120, env=None if env is None else {**os.environ, **env}, **kwargs)


def assert_fails_cleanly(result, code: int, *fragments: str) -> None:
    """Exit `code` with one line on stderr naming the problem, and no traceback."""
    assert result.exit_code == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfm: error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0]


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.strip().splitlines()]


# --------------------------------------------------------------------------- the program


def test_help_lists_the_commands():
    r = python("-m", "transformer_cli", "--help")
    assert r.returncode == 0, r.stderr
    for command in ("train", "predict", "evaluate"):
        assert command in r.stdout


def test_version_is_the_installed_packages():
    from importlib.metadata import version

    r = python("-m", "transformer_cli", "--version")
    assert r.returncode == 0 and r.stdout == f"tfm {version('transformer-cli')}\n", (r.stdout, r.stderr)
    r = python("-m", "transformer_cli", "--help")
    assert r.returncode == 0 and "--version" in r.stdout and "Train, evaluate and run" in r.stdout


def test_importing_the_cli_does_not_import_torch():
    r = python("-c", "import sys, transformer_cli.cli; assert 'torch' not in sys.modules, 'torch imported'")
    assert r.returncode == 0, r.stderr


def test_train_without_progress_prints_only_the_summary_line(synthetic_data_dir, tmp_path):
    # A fresh cache, so that the tokenizer is trained in this process (and can't print anything).
    r = python("-m", "transformer_cli", "train", "--config", str(CONFIGS / "tiny.toml"), "--data",
               str(synthetic_data_dir), "-o", str(tmp_path / "run"), "--no-progress", "--epochs", "1",
               env={"TFM_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("done: best val accuracy") and r.stdout.count("\n") == 1, repr(r.stdout)


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def cli_run(synthetic_data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "run"
    r = tfm("train", "--config", CONFIGS / "tiny.toml", "--data", synthetic_data_dir, "-o", out, "--test")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.startswith("done: best val accuracy")
    metrics = json.loads((out / "metrics.json").read_text())
    assert f"{metrics['val']['accuracy']:.4f}" in r.stdout
    assert f"test accuracy {metrics['test']['accuracy']:.4f}" in r.stdout
    return out


def test_predict_prints_label_and_probability(cli_run):
    r = tfm("predict", "-c", cli_run, POSITIVE_TEXT, NEGATIVE_TEXT)
    assert r.exit_code == 0, r.stderr
    lines = [line.split("\t") for line in r.stdout.strip().splitlines()]
    assert [(label, text) for label, _, text in lines] == [("pos", POSITIVE_TEXT), ("neg", NEGATIVE_TEXT)]
    assert all(0.5 <= float(score) <= 1.0 for _, score, _ in lines)


def test_predict_json(cli_run):
    texts = [POSITIVE_TEXT, NEGATIVE_TEXT, "the plot"]
    r = tfm("predict", "-c", cli_run, "--json", *texts)
    assert r.exit_code == 0, r.stderr
    results = json_lines(r.stdout)
    assert len(results) == len(texts)
    for result in results:
        assert set(result) == {"label", "score", "probabilities"}
        assert set(result["probabilities"]) == {"neg", "pos"}
        assert sum(result["probabilities"].values()) == pytest.approx(1.0)
        assert result["score"] == max(result["probabilities"].values())
        assert result["probabilities"][result["label"]] == result["score"]
    assert [r["label"] for r in results[:2]] == ["pos", "neg"]


@pytest.fixture
def review_lines(test_rows) -> list[str]:
    return [r["text"] for r in test_rows[:12]]


@pytest.mark.parametrize("source", ["path", "stdin"])
def test_predict_reads_a_file_in_order(cli_run, review_lines, tmp_path, source):
    expected = json_lines(tfm("predict", "-c", cli_run, "--json", *review_lines).stdout)
    content = "\n".join(review_lines) + "\n"
    if source == "path":
        path = tmp_path / "reviews.txt"
        path.write_text(content, encoding="utf-8")
        r = tfm("predict", "-c", cli_run, "--json", "--file", path)
    else:
        r = tfm("predict", "-c", cli_run, "--json", "--file", "-", input=content)
    assert r.exit_code == 0, r.stderr
    got = json_lines(r.stdout)
    assert [g["label"] for g in got] == [e["label"] for e in expected]
    assert [g["score"] for g in got] == pytest.approx([e["score"] for e in expected], abs=1e-6)


def test_predict_reads_latin1_with_a_warning(cli_run, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Un film superbe, great et wonderful. Très bien\n".encode("latin-1"))
    r = tfm("predict", "-c", cli_run, "--file", path)
    assert r.exit_code == 0, r.stderr
    assert "warning" in r.stderr and "Latin-1" in r.stderr
    assert len(r.stdout.strip().splitlines()) == 1
    assert "Très bien" in r.stdout


def test_predict_reads_a_text_argument_that_is_not_utf8_as_latin1(cli_run):
    """The shell passes bytes; those that are not UTF-8 reach Python as lone surrogates, which the
    tokenizer would refuse."""
    argument = os.fsdecode("Un film superbe, great et wonderful. Très bien".encode("latin-1"))
    r = tfm("predict", "-c", cli_run, argument)
    assert r.exit_code == 0, r.stderr
    assert "warning: text 1 is not UTF-8; read it as Latin-1" in r.stderr
    assert "Très bien" in r.stdout


@pytest.mark.parametrize(("bom", "encoding"), [
    (codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"),
], ids=["utf-8-bom", "utf-16-le", "utf-16-be"])
def test_predict_reads_a_file_with_a_byte_order_mark(cli_run, review_lines, tmp_path, bom, encoding):
    """Notepad's UTF-8 with a mark and PowerShell's UTF-16 (`>`) give what the same reviews in plain UTF-8
    give: the mark is no part of the first review, and UTF-16 is not read as Latin-1."""
    content = "\r\n".join(["Très bien, great and wonderful", *review_lines[:4]]) + "\r\n"
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_bytes(content.encode("utf-8"))
    marked.write_bytes(bom + content.encode(encoding))
    for args in ([], ["--json"]):
        expected = tfm("predict", "-c", cli_run, *args, "--file", plain)
        r = tfm("predict", "-c", cli_run, *args, "--file", marked)
        assert r.exit_code == 0 and r.stderr == "", r.stderr  # no Latin-1 warning
        assert len(r.stdout.splitlines()) == 5
        assert r.stdout == expected.stdout  # the same labels, probabilities (--json) and texts
        if not args:
            assert r.stdout.splitlines()[0].endswith("\tTrès bien, great and wonderful")


def test_predict_refuses_a_file_that_is_not_the_utf_16_its_mark_says(cli_run, tmp_path):
    path = tmp_path / "broken.txt"
    path.write_bytes(codecs.BOM_UTF16_LE + "great film\n".encode("utf-16-le") + b"x")  # an odd number of bytes
    assert_fails_cleanly(tfm("predict", "-c", cli_run, "--file", path), 2, f"--file '{path}'", "UTF-16 byte-order mark",
                         "save it as UTF-8")


def test_predict_splits_a_file_at_newlines_only(cli_run, tmp_path):
    # \x85 is an ellipsis in Windows-1252 (read as Latin-1: NEL), \x0c a form feed, \u2028 a line separator.
    path = tmp_path / "reviews.txt"
    path.write_bytes(b"Great film\x85 loved it\r\nTerrible \x0c boring\nawful\n")
    r = tfm("predict", "-c", cli_run, "--file", path)
    assert r.exit_code == 0, r.stderr
    assert [line.split("\t")[2] for line in r.stdout.splitlines()] == [
        "Great film loved it", "Terrible boring", "awful"]  # three reviews; their lines show spaces
    path.write_text("loved it\u2028superb\n\nx\n", encoding="utf-8")
    assert_fails_cleanly(tfm("predict", "-c", cli_run, "--file", path), 2, "line 2 of", "is empty")
    path.write_text("great\nawful\n\n  \n")  # blank lines at the end are no reviews
    r = tfm("predict", "-c", cli_run, "--file", path)
    assert r.exit_code == 0 and [line.split("\t")[2] for line in r.stdout.splitlines()] == ["great", "awful"]
    path.write_text("\n\n")
    assert_fails_cleanly(tfm("predict", "-c", cli_run, "--file", path), 2, "no input")


def test_predict_prints_one_line_per_review_whatever_its_whitespace(cli_run):
    r = tfm("predict", "-c", cli_run, "great\nfilm", "awful\tboring  film")
    assert r.exit_code == 0, r.stderr
    assert [line.split("\t")[2] for line in r.stdout.splitlines()] == ["great film", "awful boring film"]


def test_snippets_read_only_the_start_but_show_what_collapsing_the_whole_would():
    import random

    from transformer_cli.console import snippet

    def reference(text: str) -> str:
        line = " ".join(text.split())
        return line if len(line) <= 60 else line[:57] + "..."

    rng = random.Random(0)
    pieces = ["great", "film", "a", "x" * 70, " ", "  ", "\t", "\n", "\u2028", " " * 300]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.choice([rng.randint(1, 8), rng.randint(8, 120)])))
             for _ in range(400)]
    cut = sum(reference(t).endswith("...") for t in texts)
    blank_start = sum(len(t) > 240 and len(" ".join(t[:240].split())) <= 60 for t in texts)
    assert cut > 100 and len(texts) - cut > 50 and blank_start > 10  # every case is there
    for text in texts:
        assert snippet(text) == reference(text), text


def test_predict_from_a_closed_stdin_fails_cleanly(cli_run):
    r = python("-m", "transformer_cli", "predict", "-c", str(cli_run), "--file", "-", preexec_fn=lambda: os.close(0))
    assert r.returncode == 2 and r.stderr.startswith("tfm: error: --file -: standard input is closed"), r.stderr


def test_evaluate_json(cli_run, test_rows):
    r = tfm("evaluate", "-c", cli_run, "--json")
    assert r.exit_code == 0, r.stderr
    (m,) = json_lines(r.stdout)
    assert {"accuracy", "macro_f1", "per_class", "loss", "confusion_matrix", "labels", "num_examples"} <= m.keys()
    assert m["labels"] == ["neg", "pos"] and list(m["per_class"]) == ["neg", "pos"]
    assert m["num_examples"] == len(test_rows) == sum(map(sum, m["confusion_matrix"]))
    (tn, _), (_, tp) = m["confusion_matrix"]
    assert m["accuracy"] == pytest.approx((tn + tp) / len(test_rows))
    run = json.loads((cli_run / "metrics.json").read_text())
    at_training_end = run["test"]  # same model, same split, same precision (the run's "auto")
    assert m["confusion_matrix"] == at_training_end["confusion_matrix"]
    assert m["loss"] == pytest.approx(at_training_end["loss"], rel=1e-6)
    assert m["compute_dtype"] == run["precision"]


def test_evaluate_text_report(cli_run):
    r = tfm("evaluate", "-c", cli_run)
    assert r.exit_code == 0, r.stderr
    m = json.loads(tfm("evaluate", "-c", cli_run, "--json").stdout)
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{m['data']} [test]: {m['num_examples']} examples, ")
    assert lines[1:4] == [f"  {title:<10} {m[key]:.4f}" for title, key in
                          (("accuracy", "accuracy"), ("macro F1", "macro_f1"), ("loss", "loss"))]
    assert lines[4].split() == ["class", "precision", "recall", "f1", "support"]
    for line, name in zip(lines[5:7], ("neg", "pos")):
        c = m["per_class"][name]
        assert line.split() == [name, *(f"{c[k]:.4f}" for k in ("precision", "recall", "f1")), str(c["support"])]
    (tn, fp), (fn, tp) = m["confusion_matrix"]
    assert lines[7] == "  confusion (rows: true, columns: predicted)"
    table = [["neg", "pos"], ["neg", str(tn), str(fp)], ["pos", str(fn), str(tp)]]
    assert [line.split() for line in lines[8:11]] == table
    assert lines[11:] == [f"  ece        {m['ece']:.4f} (temperature {m['temperature']:.3f})"]


def test_evaluation_report_of_three_labels():
    import numpy as np

    from transformer_cli.console import evaluation_report
    from transformer_cli.evaluate import metrics_from_confusion

    m = metrics_from_confusion(np.array([[1, 2, 0], [0, 3, 0], [1, 0, 12]]), ["a", "bee", "c"])
    m.update({"data": "d", "split": "test", "examples_per_sec": 1.0, "loss": 1.0})
    assert evaluation_report(m).splitlines()[4:] == [
        "  class  precision  recall      f1  support",
        "  a         0.5000  0.3333  0.4000        3",
        "  bee       0.6000  1.0000  0.7500        3",
        "  c         1.0000  0.9231  0.9600       13",
        "  confusion (rows: true, columns: predicted)",
        "           a  bee    c",
        "  a        1    2    0",
        "  bee      0    3    0",
        "  c        1    0   12",
    ]


# --------------------------------------------------------------------------- errors


def test_predict_with_a_missing_checkpoint_fails_cleanly(tmp_path):
    assert_fails_cleanly(tfm("predict", "-c", tmp_path / "nope", "good"), 1, "does not exist")


@pytest.mark.parametrize(
    ("make_args", "fragment"),
    [
        (lambda ckpt, tmp: ["predict", "-c", ckpt, ""], "empty"),
        (lambda ckpt, tmp: ["predict", "-c", ckpt, "--file", tmp], "directory"),
        (lambda ckpt, tmp: ["predict", "-c", ckpt, "--file", tmp / "missing.txt"], "does not exist"),
        (lambda ckpt, tmp: ["predict", "-c", ckpt, "--file", "-", "text"], "not both"),
        (lambda ckpt, tmp: ["train", "-o", tmp / "out", "lr=3"], "SECTION.FIELD"),
        (lambda ckpt, tmp: ["train", "-o", tmp / "out", "not-an-override"], "not-an-override"),
        (lambda ckpt, tmp: ["train", "-o", tmp / "out", "model.nope=1"], "model.nope"),
        (lambda ckpt, tmp: ["train", "-o", tmp / "out", "train.lr=-1"], "train.lr"),
        (lambda ckpt, tmp: ["train", "-o", tmp / "out", "--device", "cuda:x"], "train.device = 'cuda:x'"),
        (lambda ckpt, tmp: ["predict", "-c", ckpt, "--device", "gpu", "text"], "--device gpu: unknown device"),
        (lambda ckpt, tmp: ["evaluate", "-c", ckpt, "--device", "cuda0"], "--device cuda0: unknown device"),
        (lambda ckpt, tmp: ["predict", "-c", ckpt, "--precision", "fp8", "text"], "--precision fp8: unknown"),
        (lambda ckpt, tmp: ["evaluate", "-c", ckpt, "--precision", "fp16"], "fp16 is not supported on CPU"),
        (lambda ckpt, tmp: ["serve", "-c", ckpt, "--max-wait-ms", "nan"], "Invalid value for '--max-wait-ms'"),
        (lambda ckpt, tmp: ["serve", "-c", ckpt, "--max-wait-ms", "inf"], "--max-wait-ms must be a finite number"),
    ],
    ids=["empty-text", "file-is-dir", "file-missing", "text-and-file", "override-no-section",
         "override-no-equals", "unknown-key", "invalid-value", "train-device", "predict-device", "evaluate-device",
         "predict-precision", "evaluate-precision", "serve-wait-nan", "serve-wait-inf"],
)
def test_usage_errors_exit_2(cli_run, tmp_path, make_args, fragment):
    assert_fails_cleanly(tfm(*make_args(cli_run, tmp_path)), 2, fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["explain", "-c", "{none}", "--html", "{dir}", "good"], "--html '{dir}' is a directory"),
    (["explain", "-c", "{none}", "--html", "{file}/x.html", "good"],
     "--html '{file}/x.html' cannot be created ('{file}' is a file, not a folder)"),
    (["evaluate", "-c", "{none}", "--report", "{file}/sub"],
     "--report '{file}/sub' cannot be created ('{file}' is a file, not a folder)"),
    (["export", "-c", "{none}", "-o", "{file}/m.onnx"],
     "--output '{file}/m.onnx' cannot be created ('{file}' is a file, not a folder)"),
    (["export", "-c", "{none}", "-o", "{dir}.onnx"], "tokenizer file '{dir}.tokenizer.json' is a directory"),
    (["pseudo-label", "-c", "{none}", "-o", "{dir}/p.jsonl"], "--output '{dir}/p.jsonl' is a directory"),
    (["pseudo-label", "-c", "{none}", "-o", "{file}/p.jsonl"],
     "--output '{file}/p.jsonl' cannot be created ('{file}' is a file, not a folder)"),
    (["train", "-o", "{file}/run"], "output directory '{file}/run' cannot be created ('{file}' is a file"),
], ids=["explain-dir", "explain-under-file", "report-under-file", "export-under-file", "export-tokenizer-dir",
        "pseudo-dir", "pseudo-under-file", "train-under-file"])
def test_an_output_path_that_cannot_be_written_is_refused_first(tmp_path, args, message):
    """Before any work (the model, which does not exist here, is not even read): exit 2 and one line that
    names the path as it was given, not a temporary file's name at the end of the work."""
    paths = {"none": tmp_path / "none", "file": tmp_path / "afile", "dir": tmp_path / "adir"}
    paths["file"].write_text("keep me")
    paths["dir"].mkdir()
    (tmp_path / "adir.tokenizer.json").mkdir()
    (paths["dir"] / "p.jsonl").mkdir()
    assert_fails_cleanly(tfm(*[a.format(**paths) for a in args]), 2, message.format(**paths))
    assert paths["file"].read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "adir.tokenizer.json", "afile"]
    assert [p.name for p in paths["dir"].iterdir()] == ["p.jsonl"]


@pytest.mark.parametrize(("args", "used"), [
    ([], "/env"),
    (["data.source=/override"], "/override"),
    (["--data", "/option", "data.source=/override"], "/option"),
], ids=["env", "override-beats-env", "option-beats-both"])
def test_tfm_data_ranks_below_data_and_data_source(tmp_path, monkeypatch, args, used):
    monkeypatch.setenv("TFM_DATA", "/env")
    result = tfm("train", "-o", tmp_path / "out", *args)
    assert_fails_cleanly(result, 2, f"data path '{used}' does not exist")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "fragment"), [
    (["train", "--epochs", "abc"], "Invalid value for '--epochs'"),
    (["predict", "--nope"], "No such option: --nope (see 'tfm predict --help')"),
    (["predict", "--batch-size", "0", "text"], "Invalid value for '--batch-size'"),
    (["evaluate", "--max-samples", "-1"], "Invalid value for '--max-samples'"),
    (["nosuch"], "No such command 'nosuch'. (see 'tfm --help')"),
], ids=["bad-int", "unknown-option", "below-min", "negative", "unknown-command"])
def test_command_line_errors_are_one_line_too(args, fragment):
    """What click itself refuses, before a command runs (it would draw a multi-line box)."""
    r = python("-m", "transformer_cli", *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tfm: error: ") and fragment in r.stderr, r.stderr
    assert r.stdout == ""


def test_tfm_alone_prints_the_help():
    r = python("-m", "transformer_cli")
    assert r.returncode == 2 and "Usage: tfm" in r.stdout + r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(("content", "fragment"), [
    ("[model]\nd_model = 16\nheads = 2\n", "model.heads"),
    ("epochs = 3\n[model]\nd_model = 16\n", "epochs"),  # a key outside any [section]
], ids=["in-section", "top-level"])
def test_unknown_key_in_a_config_file_exits_2(tmp_path, content, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    assert_fails_cleanly(tfm("train", "--config", path, "-o", tmp_path / "out"), 2, fragment)


@pytest.mark.parametrize("text", ["Loved it 😍🎬🍿 ✨", "great " * 200_000, "   \t "],
                         ids=["emoji", "one-megabyte", "whitespace"])
def test_unusual_reviews(cli_run, text):
    result = tfm("predict", "-c", cli_run, "--json", text)
    if not text.strip():
        assert_fails_cleanly(result, 2, "empty")
        return
    assert result.exit_code == 0, result.stderr
    (r,) = json_lines(result.stdout)
    assert r["label"] in ("neg", "pos") and 0.5 <= r["score"] <= 1.0  # a real, finite probability


@pytest.mark.parametrize(("rows", "code", "fragment"), [
    ([{"review": "good", "label": 1}] * 4, 1, "no column 'text'"),
    ([{"text": "good", "label": "pos"}] * 4 + [{"text": "so-so", "label": "mixed"}], 1,
     "class 'mixed' has no examples in the validation part"),
    ([{"text": "good", "label": 1}, {"text": "bad", "label": 1.5}] * 2, 1,
     "labels must be integers or class names (text)"),
    ([{"text": "good", "label": ["pos", "funny"]}] * 4, 1, "a list: multi-label data is not supported"),
    ([{"text": "good", "stars": 1}] * 4, 1, "no column 'label'"),
], ids=["no-text-column", "a-class-too-small-to-validate-on", "a-fraction", "list-labels", "no-label-column"])
def test_bad_datasets_fail_cleanly(tmp_path, rows, code, fragment):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert_fails_cleanly(tfm("train", "--data", data, "-o", out, "--no-progress"), code, fragment)
    assert not out.exists()  # nothing is written before the data is known to be good


@pytest.mark.parametrize(("name", "content", "code", "fragment"), [
    ("bad.jsonl", b'{"text": "a", "label": 0}\n{bad json\n', 1, ("could not read {path}: An error occurred while "
                                                                  "generating the dataset: JSON parse error")),
    ("bad.csv", b'text,label\n"unterminated,0\nb,1\n', 1, "Error tokenizing data"),
    ("empty.csv", b"", 1, "data file '{path}' is empty: fill it or remove it"),
    ("header.csv", b"text,label\n", 1, "data file '{path}' has a header line but no rows: fill it or remove it"),
    ("fake.tar.gz", b"\x00not an archive" * 100, 1, "could not read '{path}' as a tar archive"),
], ids=["jsonl", "csv", "empty-csv", "header-only-csv", "tarball"])
def test_unreadable_data_files_fail_in_one_line_that_says_why(tmp_path, name, content, code, fragment):
    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "out"
    assert_fails_cleanly(tfm("train", "--data", path, "-o", out, "--no-progress"), code, fragment.format(path=path))
    assert not out.exists()


def test_a_data_path_that_does_not_exist_is_a_usage_error(tmp_path):
    """The rule: what was typed is wrong (an option, a value, a path that does not exist) -> 2; what a file holds
    is wrong (empty, no rows, a missing column, bad labels) -> 1."""
    out = tmp_path / "out"
    assert_fails_cleanly(tfm("train", "--data", tmp_path / "nowhere.csv", "-o", out, "--no-progress"), 2,
                         "does not exist")
    assert not out.exists()


def test_no_help_shows_a_value_for_a_flag():
    commands = ["train", "pretrain", "predict", "evaluate", "pseudo-label", "export", "serve", "explain", "inspect"]
    for command in [[], *([c] for c in commands)]:
        result = tfm(*command, "--help")
        assert result.exit_code == 0 and "<bool>" not in result.stdout, (command, result.stdout)


def test_imbalance_warning_names_the_class_never_predicted():
    from transformer_cli.console import imbalance_warning
    from transformer_cli.evaluate import metrics_from_confusion

    majority = metrics_from_confusion([[95, 0], [5, 0]], ["common", "rare"])  # every example called "common"
    warning = imbalance_warning(majority)
    assert warning.startswith("it never predicts 'rare' on validation (macro-F1 0.4872, accuracy 0.9500)")
    assert "train.class_weights=balanced" in warning and "train.select_metric=macro_f1" in warning
    weighted = imbalance_warning(majority, "balanced")  # only what the run has not set is suggested
    assert "class_weights" not in weighted and "train.select_metric=macro_f1" in weighted
    both = imbalance_warning(majority, [1.0, 9.0], "macro_f1")
    assert "class_weights" not in both and "select_metric" not in both and "more examples" in both
    assert imbalance_warning(metrics_from_confusion([[90, 5], [3, 2]], ["common", "rare"])) is not None  # F1 low
    assert imbalance_warning(metrics_from_confusion([[48, 2], [3, 47]], ["neg", "pos"])) is None
    untrained = imbalance_warning(metrics_from_confusion([[50, 0], [50, 0]], ["neg", "pos"]))  # balanced classes
    assert untrained.startswith("it never predicts 'pos'") and "longer" in untrained and "imbalanced" not in untrained


def fail_in_predict(monkeypatch, error: Exception) -> None:
    """`tfm predict` raises `error` from the library function it calls."""
    from transformer_cli import evaluate

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(evaluate, "predict_texts", fails)


def test_an_error_message_of_several_lines_is_printed_as_one(monkeypatch, tmp_path):
    from transformer_cli.errors import TfmError

    fail_in_predict(monkeypatch, TfmError("could not read it:\n- method gz: not gzip\n- method tar: bad header\n"))
    result = tfm("predict", "-c", tmp_path, "good")
    assert result.exit_code == 1
    assert result.stderr == "tfm: error: could not read it: - method gz: not gzip - method tar: bad header\n"


@pytest.mark.parametrize("error", [
    MemoryError(),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 4398046511104 bytes. Error code 12 (Cannot allocate memory)"),
], ids=["MemoryError", "cpu-allocator"])
def test_out_of_memory_says_what_to_lower(monkeypatch, tmp_path, error):
    fail_in_predict(monkeypatch, error)
    result = tfm("predict", "-c", tmp_path, "good")
    assert result.exit_code == 1
    assert result.stderr.startswith("tfm: error: out of memory; lower --batch-size, data.max_length")


@pytest.mark.parametrize(("error", "code", "line"), [
    (KeyboardInterrupt(), 130, "tfm: error: interrupted"),
    (PermissionError(13, "Permission denied", "runs/x"), 1, "tfm: error: Permission denied 'runs/x'"),
    (ValueError("boom"), 1, "tfm: error: unexpected ValueError: boom (set TFM_DEBUG=1 to see the traceback)"),
], ids=["ctrl-c", "os-error", "bug"])
def test_any_error_in_a_command_is_one_line_and_an_exit_code(monkeypatch, tmp_path, error, code, line):
    fail_in_predict(monkeypatch, error)
    assert_fails_cleanly(tfm("predict", "-c", tmp_path, "good"), code)
    assert tfm("predict", "-c", tmp_path, "good").stderr == line + "\n"
    if isinstance(error, ValueError):
        monkeypatch.setenv("TFM_DEBUG", "1")
        assert tfm("predict", "-c", tmp_path, "good").exception is error  # re-raised, with its traceback


def test_test_without_a_test_split_is_refused_before_training(tmp_path, test_rows):
    data = write_jsonl(tmp_path / "train-only.jsonl", test_rows)
    out = tmp_path / "out"
    result = tfm("train", "--config", CONFIGS / "tiny.toml", "--data", data, "-o", out, "--test", "--no-progress")
    assert_fails_cleanly(result, 2, "has no 'test' split")
    assert not out.exists()


def test_named_data_files_must_be_split_equals_file(tmp_path):
    result = tfm("train", "--data", "train=a.csv,garbage", "-o", tmp_path / "out")
    assert_fails_cleanly(result, 2, "write named files as SPLIT=FILE[,SPLIT=FILE...]")
