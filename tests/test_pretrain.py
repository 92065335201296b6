"""`tfm pretrain` (masked-LM on unlabelled text) and fine-tuning from its encoder (`train.init_from`)."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CONFIGS, make_examples, read_scalars, tiny_config, write_jsonl
from safetensors.torch import load_file, save_file
from test_train import assert_same_weights, final_weights, set_up

from transformer_cli import checkpoint as ckpt
from transformer_cli.config import CLASSIFIER_ONLY, ModelConfig, PretrainConfig, load_config
from transformer_cli.data import Encoded, encode_texts
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.model import LMHead, MaskedLM
from transformer_cli.runtime import make_runtime
from transformer_cli.tokens import CLS_ID, MASK_ID, PAD_ID, SPECIAL_TOKENS
from transformer_cli.training import loop
from transformer_cli.training import pretrain as pretrain_mod
from transformer_cli.training.classify import train
from transformer_cli.training.loop import Interrupted
from transformer_cli.training.pretrain import (
    Corpus,
    MaskedLanguageModelling,
    check_classifier_only,
    cut_windows,
    load_token_file,
    mask_tokens,
    prepare_corpus,
    pretrain,
    text_splits,
    write_token_file,
)
from transformer_cli.training.run import release_output_dirs

VOCAB = 60


def batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(5, VOCAB, (len(lengths), T), generator=g)
    ids[:, 0] = CLS_ID
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return ids.masked_fill(~mask, PAD_ID), mask


# --------------------------------------------------------------------------- the objective


def test_masking_picks_real_tokens_only_and_replaces_them_as_bert_does():
    ids, mask = batch([200, 150, 90, 1] * 50)
    masked, picked, targets = mask_tokens(ids, mask, 0.15, VOCAB, torch.Generator().manual_seed(1))
    flat_mask = mask.clone()
    flat_mask[:, 0] = False
    assert flat_mask.view(-1)[picked].all()  # never [CLS] or padding
    assert torch.equal(targets, ids.view(-1)[picked])
    share = len(picked) / flat_mask.sum().item()
    assert 0.14 < share < 0.16
    new = masked.view(-1)[picked]
    as_mask = (new == MASK_ID).float().mean().item()
    kept = (new == targets).float().mean().item()
    assert 0.77 < as_mask < 0.83 and 0.08 < kept < 0.13  # 80% [MASK]; 10% kept (+ random draws of the same id)
    drawn = new[(new != MASK_ID) & (new != targets)]  # the 10% replaced by a random word
    assert 0.08 < len(drawn) / len(new) < 0.12
    assert (drawn >= len(SPECIAL_TOKENS)).all() and (drawn < VOCAB).all()  # words, never [PAD], [CLS] or [MASK]
    untouched = torch.ones(masked.numel(), dtype=torch.bool)
    untouched[picked] = False
    assert torch.equal(masked.view(-1)[untouched], ids.view(-1)[untouched])


def test_masking_picks_at_least_one_token():
    ids, mask = batch([3, 2])
    _, picked, _ = mask_tokens(ids, mask, 1e-6, VOCAB, torch.Generator().manual_seed(0))
    assert len(picked) == 1 and picked.item() % ids.size(1) != 0


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_masked_lm_loss_equals_the_straightforward_full_vocabulary_loss(norm):
    """The head runs on the picked positions only; the reference scores every position and ignores
    the unpicked ones in the loss."""
    cfg = ModelConfig(d_model=32, n_heads=4, n_layers=2, ff_mult=2, dropout=0.0, norm=norm)
    torch.manual_seed(0)
    model = MaskedLM(cfg, VOCAB, 64)
    ids, mask = batch([40, 25, 7, 33], seed=3)
    masked, picked, targets = mask_tokens(ids, mask, 0.3, VOCAB, torch.Generator().manual_seed(2))
    loss, stats = model(masked, mask, picked, targets)
    loss.backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    labels = torch.full_like(ids, -100).view(-1)
    labels[picked] = targets
    logits = model.lm_head(model.encoder(masked, mask).flatten(0, 1), model.encoder.tok_emb.weight)  # (B * T, V)
    reference = F.cross_entropy(logits, labels, ignore_index=-100)
    reference.backward()
    torch.testing.assert_close(loss, reference)
    expected_accuracy = (logits[picked].argmax(-1) == targets).float().mean()
    torch.testing.assert_close(stats["accuracy"], expected_accuracy)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fast[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_output_layer_shares_the_token_embedding():
    model = MaskedLM(ModelConfig(d_model=16, n_heads=2, n_layers=1), VOCAB, 32)
    names = [n for n, _ in model.named_parameters()]
    assert "encoder.tok_emb.weight" in names and not any("decoder" in n for n in names)
    transform = {f"lm_head.transform.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")}
    assert {n for n in names if n.startswith("lm_head.")} == {"lm_head.bias", *transform}


@pytest.mark.parametrize("n", [1, 64, 130])
def test_the_output_layer_runs_on_rows_padded_to_few_shapes_and_equals_the_unpadded_layer(n, monkeypatch):
    """Whatever the number of masked tokens, the head's matmuls see a multiple of ROW_MULTIPLE rows (few
    shapes, so that the CPU's matmul library keeps few packed copies of the embedding), and give the
    scores and gradients of the head on the rows alone."""
    torch.manual_seed(0)
    model = MaskedLM(ModelConfig(d_model=16, n_heads=2, n_layers=1), VOCAB, 32)
    h, weights = torch.randn(n, 16, requires_grad=True), torch.randn(n, VOCAB)
    rows, linear = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: rows.append(x.shape[0]) or linear(x, w, b))  # a spy
    emb, head = model.encoder.tok_emb.weight, model.lm_head
    scores = head(h, emb)  # (n, V)
    monkeypatch.undo()
    padded = -(-n // LMHead.ROW_MULTIPLE) * LMHead.ROW_MULTIPLE
    assert scores.shape == (n, VOCAB) and rows == [padded, padded]  # the transform's and the scores' matmuls
    params = [h, *head.parameters(), emb]
    expected = head.transform(h) @ emb.T + head.bias  # (n, V)
    torch.testing.assert_close(scores, expected)
    got, want = (torch.autograd.grad((s * weights).sum(), params) for s in (scores, expected))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- windows of the texts


def texts_of(lengths: list[int], seed: int = 0) -> Encoded:
    """Texts of these lengths, each [CLS] then random word ids."""
    rng = np.random.default_rng(seed)
    parts = [np.concatenate([[CLS_ID], rng.integers(5, VOCAB, n - 1)]) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return Encoded(np.concatenate(parts).astype(np.int32), offsets, np.zeros(len(lengths), dtype=np.int64))


def test_windows_tile_each_text_in_near_equal_parts_that_know_their_positions():
    lengths = [1, 5, 16, 17, 40, 300]
    texts = texts_of(lengths)
    windows, starts, text = cut_windows(texts, 16)
    assert list(np.bincount(text)) == [1, 1, 1, 2, 3, 19]  # the fewest windows of at most 16 tokens
    for t, n in enumerate(lengths):
        mine = np.flatnonzero(text == t)
        sizes = windows.lengths[mine]
        assert sizes.max() <= 16 and sizes.max() - sizes.min() <= 1 and sizes.sum() == n
        assert list(starts[mine]) == [0, *np.cumsum(sizes)[:-1]]  # each window's place in its text
        whole = texts.ids[texts.offsets[t] : texts.offsets[t + 1]]
        assert np.array_equal(np.concatenate([windows.subset([i]).ids for i in mine]), whole)
    same, starts0, text0 = cut_windows(texts, 0)  # 0: the texts whole
    assert same is texts and not starts0.any() and list(text0) == list(range(len(lengths)))


def test_a_windowed_batch_holds_each_windows_tokens_at_their_positions_in_its_text():
    texts = texts_of([40, 9, 33], seed=1)
    corpus = Corpus(None, texts, np.array([0, 1]), np.array([2]), 0)
    task = MaskedLanguageModelling(corpus, PretrainConfig(window=16, mask_prob=0.5), VOCAB)
    assert task.num_train == 3 + 1 and task.num_val == 3  # 40 tokens: 3 windows; 9: one; the held-out 33: 3
    torch.manual_seed(0)
    batch = task.batch(make_runtime("cpu", "fp32"), np.arange(task.num_train))
    masked, mask, picked, targets, positions = batch.tensors
    ids = masked.clone().view(-1)
    ids[picked] = targets  # the windows as they were before masking
    ids = ids.view(masked.shape)
    for row, (start, n) in enumerate([(0, 13), (13, 13), (26, 14), (0, 9)]):
        text = 0 if row < 3 else 1
        expected = texts.ids[texts.offsets[text] + start : texts.offsets[text] + start + n]
        assert np.array_equal(ids[row, :n].numpy(), expected)
        assert positions[row, :n].tolist() == list(range(start, start + n))
        assert not positions[row, n:].any() and not mask[row, n:].any()
    is_cls = ids.view(-1)[picked] == CLS_ID
    assert not is_cls.any()  # [CLS] is never a target; a later window's first token may be
    assert (picked % masked.size(1) == 0).any()


def test_positions_place_a_windows_tokens_as_they_stand_in_the_text():
    """A window given its positions in its text is encoded as if it stood there: as the same tokens in
    those columns of a longer row whose other columns are masked out."""
    torch.manual_seed(0)
    model = MaskedLM(ModelConfig(d_model=16, n_heads=2, n_layers=1, dropout=0.0), VOCAB, 64).eval()
    ids, mask = batch([10, 6], seed=4)
    positions = torch.tensor([list(range(30, 40)), [50, 51, 52, 53, 54, 55, 0, 0, 0, 0]])
    windowed = model.encoder(ids, mask, positions)
    for row, n in enumerate([10, 6]):
        cols = positions[row, :n]
        placed = torch.zeros(1, 64, dtype=ids.dtype).index_put_((torch.zeros_like(cols), cols), ids[row, :n])
        in_place = model.encoder(placed, torch.zeros(1, 64, dtype=torch.bool).index_fill_(1, cols, True))
        torch.testing.assert_close(windowed[row, :n], in_place[0, cols])
    masked, picked, targets = mask_tokens(ids, mask, 0.5, VOCAB, torch.Generator().manual_seed(0))
    moved, _ = model(masked, mask, picked, targets, positions)
    unmoved, _ = model(masked, mask, picked, targets)
    assert moved.item() != pytest.approx(unmoved.item(), rel=1e-6)  # the positions reach the loss


def test_with_rope_a_window_needs_no_place_in_its_text():
    """Rotary positions are relative: a window moved along its text, every token by the same places,
    gives the same loss."""
    torch.manual_seed(0)
    model = MaskedLM(ModelConfig(d_model=16, n_heads=2, n_layers=1, dropout=0.0, pos_emb="rope"), VOCAB, 64)
    ids, mask = batch([10, 6], seed=4)
    positions = torch.tensor([list(range(30, 40)), [50, 51, 52, 53, 54, 55, 0, 0, 0, 0]])
    masked, picked, targets = mask_tokens(ids, mask, 0.5, VOCAB, torch.Generator().manual_seed(0))
    moved, _ = model(masked, mask, picked, targets, positions)
    unmoved, _ = model(masked, mask, picked, targets)
    assert moved.item() == pytest.approx(unmoved.item(), rel=1e-5)


# --------------------------------------------------------------------------- text larger than memory


def pretrain_config(data: Path | str, out: Path, **overrides):
    return tiny_config(data, out, **overrides)


def test_the_token_file_written_in_small_chunks_is_memory_mapped_and_equals_encoding_at_once(
        synthetic_data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain_mod, "SHARD_TEXTS", 7)  # texts a chunk: 400 texts make 58 chunks
    cfg = pretrain_config(synthetic_data_dir, tmp_path / "run")
    corpus = prepare_corpus(cfg)
    texts = [r["text"] for r in map(json.loads, (synthetic_data_dir / "train.jsonl").read_text().splitlines())]
    ids, offsets = encode_texts(corpus.tokenizer, texts, cfg.data.max_length, cfg.data.truncation)
    assert isinstance(corpus.texts.ids, np.memmap)  # read from disk as batches need it, never loaded whole
    assert np.array_equal(corpus.texts.offsets, offsets)
    assert np.array_equal(np.asarray(corpus.texts.ids), ids)
    held_out = cfg.pretrain.val_texts
    assert len(corpus.val_idx) == held_out and len(corpus.train_idx) == len(texts) - held_out
    assert not set(corpus.val_idx) & set(corpus.train_idx)


def test_the_token_file_is_written_chunk_by_chunk(synthetic_data_dir, tmp_path, monkeypatch):
    """Each chunk is encoded and written before the next is read: the writer never holds two."""
    cfg = pretrain_config(synthetic_data_dir, tmp_path / "run")
    corpus = prepare_corpus(cfg)
    encoded = []
    monkeypatch.setattr(pretrain_mod, "encode_texts", lambda tok, texts, *a: encoded.append(len(texts))
                        or encode_texts(tok, texts, *a))  # a spy: what is encoded when

    texts = [[f"text number {i} {'word ' * j}" * (i + 1) for j in range(3)] for i in range(5)]

    def chunks():
        for i in range(5):
            assert len(encoded) == i  # every chunk before this one, and no more
            yield texts[i]

    enc = write_token_file(tmp_path / "tokens", corpus.tokenizer, chunks(), cfg)
    assert len(enc) == 15 and encoded == [3] * 5
    loaded = load_token_file(tmp_path / "tokens", 15)
    d = cfg.data
    for k, text in enumerate(t for chunk in texts for t in chunk):  # each text's ids, across chunk boundaries
        ids, _ = encode_texts(corpus.tokenizer, [text], d.max_length, d.truncation)
        for written in (enc, loaded):
            assert written.ids[written.offsets[k] : written.offsets[k + 1]].tolist() == ids.tolist(), k
    assert load_token_file(tmp_path / "tokens", 14) is None  # a file of other texts is not taken


def test_a_token_file_another_process_wrote_meanwhile_is_kept(synthetic_data_dir, tmp_path):
    """Two runs encoding the same corpus at once (a sweep, or torchrun ranks on several machines): the
    second to finish keeps the first one's folder instead of failing on the rename."""
    cfg = pretrain_config(synthetic_data_dir, tmp_path / "run")
    corpus = prepare_corpus(cfg)
    texts = [[f"text number {i} " * (i + 1)] * 3 for i in range(5)]
    theirs = write_token_file(tmp_path / "theirs", corpus.tokenizer, iter(texts), cfg)
    target = tmp_path / "cache" / "tokens"

    def chunks():  # the other process renames its folder into place while this one encodes
        yield from texts
        shutil.copytree(tmp_path / "theirs", target)
        (target / "read-by-the-other-process").touch()

    ours = write_token_file(target, corpus.tokenizer, chunks(), cfg)
    assert np.array_equal(np.asarray(ours.ids), np.asarray(theirs.ids)) and len(ours) == 15
    assert (target / "read-by-the-other-process").exists()  # not deleted under the process reading it
    assert [p.name for p in target.parent.iterdir()] == ["tokens"]  # no temporary folder left


def test_pretraining_reads_plain_text_files_and_refuses_the_test_split(tmp_path):
    lines = [r["text"] for r in make_examples(120, seed=5)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = pretrain_config(path, tmp_path / "run")
    (table,) = text_splits(cfg)
    assert table["text"] == lines
    with pytest.raises(UsageError, match="never test"):
        pretrain_config(path, tmp_path / "run", pretrain__splits=["train", "test"])


def test_blank_lines_of_a_text_file_are_no_texts(tmp_path):
    """They are skipped: neither held out, nor counted by --max-train-samples, nor trained on."""
    lines = [r["text"] for r in make_examples(120, seed=5)]
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"{line}\n\n  \t\n" for line in lines), encoding="utf-8")
    corpus = prepare_corpus(pretrain_config(path, tmp_path / "run"))
    assert len(corpus.texts) == len(lines) and len(corpus.train_idx) == len(lines) - 40
    cfg = pretrain_config(path, tmp_path / "run", data__max_train_samples=60)
    corpus = prepare_corpus(cfg)
    ids, offsets = encode_texts(corpus.tokenizer, lines[:60], cfg.data.max_length, cfg.data.truncation)
    assert np.array_equal(corpus.texts.offsets, offsets) and np.array_equal(np.asarray(corpus.texts.ids), ids)


@pytest.mark.parametrize("corpus", ["blank lines", "whitespace texts"])
def test_a_corpus_without_words_is_one_clear_error(tmp_path, corpus):
    if corpus == "blank lines":
        path, expected = tmp_path / "blank.txt", "only blank lines"
        path.write_text("\n  \n\t\n" * 40, encoding="utf-8")
    else:  # texts of a JSON lines file are kept as they are, blank or not
        path, expected = tmp_path / "blank.jsonl", "no words"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in [" ", "\t", "  \n "] * 40), encoding="utf-8")
    with pytest.raises(TfmError, match=expected) as info:
        pretrain(pretrain_config(path, tmp_path / "run"), progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()


# A value other than the default for each setting only classifier training reads.
CLASSIFIER_VALUES = {
    "data.label_column": "stars", "data.val_split": "", "data.val_size": 0.2, "data.max_eval_samples": 5,
    "data.pseudo_labels": "nonexistent.jsonl", "data.pseudo_min_score": 0.9, "train.test_at_end": True,
    "train.init_from": "runs/pretrain", "train.class_weights": "balanced",
    "data.train_max_length": 64,  # tiny.toml's max_length: valid with learned positions
}


def test_every_setting_that_only_classifier_training_reads_is_listed():
    assert set(CLASSIFIER_VALUES) == set(CLASSIFIER_ONLY)


@pytest.mark.parametrize("key", sorted(CLASSIFIER_VALUES))
def test_settings_of_classifier_training_are_refused(synthetic_data_dir, tmp_path, key):
    section, name = key.split(".")
    cfg = pretrain_config(synthetic_data_dir, tmp_path / "run").replace(**{section: {name: CLASSIFIER_VALUES[key]}})
    with pytest.raises(UsageError, match=rf"^{key} = .*`tfm pretrain` does not use it") as info:
        pretrain(cfg, progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()


def test_the_cli_refuses_classifier_settings_in_one_line_and_writes_nothing(synthetic_data_dir, tmp_path):
    from typer.testing import CliRunner

    from transformer_cli.cli import app

    result = CliRunner().invoke(app, ["pretrain", "--config", str(CONFIGS / "tiny.toml"), "--data",
                                      str(synthetic_data_dir), "-o", str(tmp_path / "run"), "train.test_at_end=true",
                                      "data.pseudo_labels=nonexistent.jsonl", "data.max_eval_samples=5"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("tfm: error: ") and len(result.stderr.strip().splitlines()) == 1
    assert "`tfm pretrain` does not use it" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("command", "override"), [
    ("train", "pretrain.mask_prob=0.3"), ("train", "pretrain.window=32"),
    ("pretrain", "model.pooling=mean"), ("pretrain", "model.token_dropout=0.1"),
    ("pretrain", "train.eval_batch_size=8"),
])
def test_an_override_the_command_would_not_use_is_refused(synthetic_data_dir, tmp_path, command, override):
    from typer.testing import CliRunner

    from transformer_cli.cli import app

    result = CliRunner().invoke(app, [command, "--config", str(CONFIGS / "tiny.toml"),
                                      "--data", str(synthetic_data_dir), "-o", str(tmp_path / "run"), override])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"tfm: error: {override.split('=')[0]} is ")
    assert f"`tfm {command}` does not use it: drop the override" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_recipe_file_may_hold_the_settings_of_both_commands():
    from transformer_cli.cli import _training_config

    recipe = CONFIGS / "tiny.toml"  # serves both commands: [pretrain] beside the classifier's pooling and word dropout
    for command in ("train", "pretrain"):
        cfg = _training_config(command, recipe, [], {}, False, None)
        assert cfg == load_config(recipe) and cfg.pretrain.val_texts != PretrainConfig().val_texts


@pytest.mark.parametrize("metric", ["loss", "accuracy"])
def test_the_cli_reports_the_held_out_figure_that_chose_the_model(synthetic_data_dir, tmp_path, metric):
    from typer.testing import CliRunner

    from transformer_cli.cli import app

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["pretrain", "--config", str(CONFIGS / "tiny.toml"), "--data",
                                      str(synthetic_data_dir), "-o", str(out), "--max-steps", "4", "--no-progress",
                                      f'train.select_metric="{metric}"'])
    assert result.exit_code == 0, result.stderr
    val = json.loads((out / "metrics.json").read_text())["val"]
    other = "accuracy" if metric == "loss" else "loss"
    assert result.stdout.startswith(f"done: best held-out masked-LM {metric} {val[metric]:.4f} ({other} "
                                    f"{val[other]:.4f}) at step ")


@pytest.mark.parametrize(("args", "recipe_dir", "expected"), [
    ([], None, "runs/pretrain"),  # not `tfm train`'s default folder
    (["train.output_dir=runs/tfm"], None, "runs/tfm"),  # named, even as tfm train's default
    ([], "runs/tfm", "runs/tfm"),
    (["-o", "runs/mine"], "runs/tfm", "runs/mine"),
])
def test_pretrain_writes_where_it_is_told_else_to_runs_pretrain(tmp_path, monkeypatch, args, recipe_dir, expected):
    from typer.testing import CliRunner

    from transformer_cli.cli import app

    recipe = tmp_path / "recipe.toml"
    named = "" if recipe_dir is None else f'output_dir = "{recipe_dir}"'
    recipe.write_text((CONFIGS / "tiny.toml").read_text().replace('output_dir = "runs/tiny"', named))
    told = []

    def fake_pretrain(cfg, **_):
        told.append(cfg.train.output_dir)
        raise TfmError("stopped before training")

    monkeypatch.setattr(pretrain_mod, "pretrain", fake_pretrain)  # the one patch: stop before training
    result = CliRunner().invoke(app, ["pretrain", "--config", str(recipe), *args])
    assert result.exit_code == 1 and told == [expected], result.stderr


@pytest.mark.parametrize("recipe", ["tiny.toml", "cpu-pretrain.toml", "gpu-pretrain.toml"])
def test_the_recipes_that_pretrain_set_no_classifier_setting(recipe):
    check_classifier_only(load_config(CONFIGS / recipe))  # tiny.toml serves `tfm train` too


def test_a_missing_split_is_one_clear_error(synthetic_data_dir, tmp_path):
    cfg = pretrain_config(synthetic_data_dir, tmp_path / "run", pretrain__splits=["unlabelled"])
    with pytest.raises(UsageError, match="has no split unlabelled"):
        text_splits(cfg)


def test_a_default_split_whose_file_datasets_does_not_read_is_refused_not_left_out(tmp_path):
    """A folder of train, test and unsupervised.jsonl: `datasets` sees train and test only. Pretraining on
    train alone would leave the unlabelled reviews out without a word; the error says how to name them."""
    folder = tmp_path / "data"
    folder.mkdir()
    for seed, name in enumerate(("train", "test", "unsupervised")):
        write_jsonl(folder / f"{name}.jsonl", make_examples(10 + seed, seed=seed))
    named = f"train={folder / 'train.jsonl'},unsupervised={folder / 'unsupervised.jsonl'}"
    with pytest.raises(UsageError, match=r"has no split unsupervised \(it has: train, test\); .*" + re.escape(
            f"did not read {folder / 'unsupervised.jsonl'} as split 'unsupervised': name the files instead "
            f"(--data {named})")):
        text_splits(pretrain_config(folder, tmp_path / "run"))
    assert [len(t) for t in text_splits(pretrain_config(named, tmp_path / "run"))] == [12, 10]


# --------------------------------------------------------------------------- a run


@pytest.fixture(scope="module")
def pretrained(synthetic_data_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("pretrained") / "run"
    metrics = pretrain(pretrain_config(synthetic_data_dir, out, train__epochs=3),
                       progress=False)
    return out, metrics


def test_a_pretraining_run_writes_the_encoder_and_the_documented_files(pretrained):
    out, metrics = pretrained
    names = {p.name for p in out.iterdir() if not p.name.startswith("events.out.tfevents.")}
    assert names == {ckpt.MODEL_FILE, ckpt.CONFIG_FILE, ckpt.TOKENIZER_FILE, ckpt.METRICS_FILE, ckpt.CKPT_DIR,
                     "README.md"}
    weights = load_file(out / ckpt.MODEL_FILE)
    assert "encoder.tok_emb.weight" in weights and "lm_head.bias" in weights
    meta = json.loads((out / ckpt.CONFIG_FILE).read_text())
    assert meta["kind"] == "pretrained encoder" and meta["num_texts"] == 400
    assert json.loads((out / ckpt.METRICS_FILE).read_text()) == metrics


def test_pretraining_logs_its_objective(pretrained):
    out, metrics = pretrained
    scalars = read_scalars(out)
    for tag in ("loss", "accuracy", "lr", "grad_norm", "tokens_per_sec"):
        assert f"pretrain/{tag}" in scalars, tag
    val = scalars["pretrain_val/loss"]
    assert [s for s, _ in val] == [s for s, _ in scalars["pretrain_val/accuracy"]] and len(val) == 3  # epoch ends
    assert metrics["val"]["loss"] == pytest.approx(min(v for _, v in val))


def test_pretraining_lowers_the_held_out_loss_far_below_guessing(tmp_path):
    """Lines of 10 words from a vocabulary of hundreds of tokens: guessing costs log(vocabulary size)
    nats; a model that has learnt which words occur costs at most log(10)."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    rng = np.random.default_rng(0)
    lines = [" ".join(words[(start + i) % 10] for i in range(12)) for start in rng.integers(0, 10, 600)]
    corpus = tmp_path / "counting.txt"
    corpus.write_text("\n".join(lines) + "\n")
    metrics = pretrain(pretrain_config(corpus, tmp_path / "run", train__epochs=8, train__batch_size=32,
                                       model__d_model=64, model__n_layers=2), progress=False)
    vocab = json.loads((tmp_path / "run" / ckpt.CONFIG_FILE).read_text())["vocab_size"]
    assert metrics["val"]["loss"] < math.log(10) + 0.1 < math.log(vocab) - 1.0


def test_pretraining_stopped_by_sigterm_resumes_exactly(synthetic_data_dir, tmp_path, monkeypatch):
    """SIGTERM while a batch is prepared: the step ends, a checkpoint is written, the run exits with
    143; --resume then ends with the weights of the run that was never stopped (its masks and dropout
    come from the RNG state the checkpoint holds; its windows from the texts)."""
    def config(out: Path, **kw):
        return pretrain_config(synthetic_data_dir, out, train__max_steps=12, train__checkpoint_every=100,
                               train__eval_every=4, pretrain__window=16, model__dropout=0.1, **kw)

    full, cut = tmp_path / "full", tmp_path / "cut"
    pretrain(config(full), progress=False)
    real, calls = MaskedLanguageModelling.batch, []

    def batch(self, *args):
        calls.append(1)
        if len(calls) == 6:
            signal.raise_signal(signal.SIGTERM)
        return real(self, *args)

    monkeypatch.setattr(MaskedLanguageModelling, "batch", batch)  # the one patch: a real signal, during step 6
    with pytest.raises(Interrupted) as info:
        pretrain(config(cut), progress=False)
    monkeypatch.undo()
    assert info.value.exit_code == 143
    assert [d.name for d in ckpt.checkpoint_dirs(cut)] == ["step-00000006"]
    with pytest.raises(UsageError, match="differ"):
        pretrain(config(cut, train__weight_decay=0.2), resume=True, progress=False)
    pretrain(config(cut), resume=True, progress=False)
    assert_same_weights(final_weights(full), final_weights(cut))
    assert read_scalars(cut)["pretrain_val/loss"] == read_scalars(full)["pretrain_val/loss"]


# --------------------------------------------------------------------------- fine-tuning from it


def test_fine_tuning_starts_from_the_pretrained_encoder_and_its_tokenizer(pretrained, synthetic_data_dir, tmp_path):
    out, _ = pretrained
    cfg = pretrain_config(synthetic_data_dir, tmp_path / "ft", train__init_from=str(out))
    run = set_up(cfg)
    saved = load_file(out / ckpt.MODEL_FILE)
    for name, tensor in run.model.encoder.state_dict().items():
        assert torch.equal(tensor, saved[f"encoder.{name}"]), name
    assert (tmp_path / "ft" / ckpt.TOKENIZER_FILE).read_text() == (out / ckpt.TOKENIZER_FILE).read_text()
    meta = json.loads((tmp_path / "ft" / ckpt.CONFIG_FILE).read_text())
    assert meta["train"]["init_from"] == str(out.resolve())  # where the encoder came from


def test_fine_tuning_takes_the_encoders_sizes_and_refuses_contradicting_ones(pretrained, synthetic_data_dir,
                                                                             tmp_path):
    out, _ = pretrained
    cfg = tiny_config(synthetic_data_dir, tmp_path / "ft", train__init_from=str(out))
    assert cfg.model.d_model == 32 and cfg.data.vocab_size == 500  # from the encoder's config.json
    # learned positions: a table of max_length rows
    changes = {"model.d_model": 64, "data.vocab_size": 900, "data.max_length": 2 * cfg.data.max_length}
    for key, value in changes.items():
        with pytest.raises(UsageError, match=f"{key} = .* contradicts the pretrained encoder"):
            tiny_config(synthetic_data_dir, tmp_path / "ft", train__init_from=str(out),
                        **{key.replace(".", "__"): value})


def test_fine_tuning_keeps_a_rope_encoders_positions(synthetic_data_dir, tmp_path):
    pre = tmp_path / "pre"
    pretrain(pretrain_config(synthetic_data_dir, pre, model__pos_emb="rope", pretrain__window=16,
                             train__max_steps=3), progress=False)
    assert not any("pos_emb" in name for name in load_file(pre / ckpt.MODEL_FILE))
    cfg = tiny_config(synthetic_data_dir, tmp_path / "ft", train__init_from=str(pre), train__max_steps=3)
    assert cfg.model.pos_emb == "rope"  # from the encoder's config.json
    with pytest.raises(UsageError, match="model.pos_emb = .* contradicts the pretrained encoder"):
        tiny_config(synthetic_data_dir, tmp_path / "ft", train__init_from=str(pre), model__pos_emb="learned")
    assert train(cfg, progress=False)["steps"] == 3
    assert json.loads((tmp_path / "ft" / ckpt.CONFIG_FILE).read_text())["model"]["pos_emb"] == "rope"


def test_fine_tuning_keeps_a_gated_encoders_feed_forward_layers(synthetic_data_dir, tmp_path):
    pre = tmp_path / "pre"
    pretrain(pretrain_config(synthetic_data_dir, pre, model__ff="geglu", train__max_steps=2), progress=False)
    assert any(".ff.gate." in name for name in load_file(pre / ckpt.MODEL_FILE))
    cfg = tiny_config(synthetic_data_dir, tmp_path / "ft", train__init_from=str(pre), train__max_steps=2)
    assert cfg.model.ff == "geglu"  # from the encoder's config.json
    with pytest.raises(UsageError, match="model.ff = 'gelu' contradicts the pretrained encoder"):
        tiny_config(synthetic_data_dir, tmp_path / "ft", train__init_from=str(pre), model__ff="gelu")
    run = set_up(cfg)
    saved = load_file(pre / ckpt.MODEL_FILE)
    for name, tensor in run.model.encoder.state_dict().items():
        assert torch.equal(tensor, saved[f"encoder.{name}"]), name


def test_fine_tuning_from_a_rope_encoder_may_read_longer_texts(synthetic_data_dir, tmp_path):
    """Rotary positions hold no table, so data.max_length is the classifier's to choose; it defaults to the
    encoder's, and the encoder's weights load the same whatever it is."""
    pre = tmp_path / "pre"
    pretrain(pretrain_config(synthetic_data_dir, pre, model__pos_emb="rope", pretrain__window=16,
                             train__max_steps=2), progress=False)
    encoder_length = json.loads((pre / ckpt.CONFIG_FILE).read_text())["data"]["max_length"]
    assert tiny_config(synthetic_data_dir, tmp_path / "a", train__init_from=str(pre)).data.max_length == encoder_length
    longer = 4 * encoder_length
    cfg = tiny_config(synthetic_data_dir, tmp_path / "ft", train__init_from=str(pre), data__max_length=longer,
                      train__max_steps=2)
    assert cfg.data.max_length == longer
    run = set_up(cfg)
    saved = load_file(pre / ckpt.MODEL_FILE)
    for name, tensor in run.model.encoder.state_dict().items():
        assert torch.equal(tensor, saved[f"encoder.{name}"]), name
    assert run.model.encoder.max_length == longer
    assert run.task.lengths.max() > encoder_length  # it trains on rows the encoder's setting would have cut
    assert train(cfg, progress=False)["steps"] == 2
    assert json.loads((tmp_path / "ft" / ckpt.CONFIG_FILE).read_text())["data"]["max_length"] == longer


def test_a_fine_tuned_run_trains_and_resumes(pretrained, synthetic_data_dir, tmp_path):
    """It learns from the encoder, and a resume continues from the checkpoint's weights (not the
    encoder's again) exactly as the run would have gone on."""
    out, _ = pretrained
    metrics = train(pretrain_config(synthetic_data_dir, tmp_path / "ft", train__init_from=str(out)), progress=False)
    assert metrics["val"]["accuracy"] >= 0.85

    def cfg(name, **kw):  # a schedule that does not depend on max_steps
        return pretrain_config(synthetic_data_dir, tmp_path / name, train__init_from=str(out), train__epochs=1,
                               train__schedule="constant", train__warmup_steps=3, **kw)

    full = train(cfg("full"), progress=False)
    assert train(cfg("split", train__max_steps=5), progress=False)["steps"] == 5 < full["steps"]
    assert train(cfg("split"), resume=True, force=True, progress=False)["steps"] == full["steps"]
    assert_same_weights(final_weights(tmp_path / "split"), final_weights(tmp_path / "full"))


def test_pretraining_validation_leaves_trainings_random_draws_as_they_were(synthetic_data_dir, tmp_path):
    """Validation masks from a fixed seed on a copy of the RNG state: how often it runs does not change
    the training (its dropout and masks)."""
    for name, every in (("often", 2), ("at-the-end", 1000)):
        pretrain(pretrain_config(synthetic_data_dir, tmp_path / name, train__max_steps=8, train__eval_every=every,
                                 model__dropout=0.1), progress=False)
    assert_same_weights(final_weights(tmp_path / "often"), final_weights(tmp_path / "at-the-end"))


def test_the_held_out_figures_do_not_depend_on_the_evaluation_batch_size(synthetic_data_dir, tmp_path):
    """The masks are drawn batch by batch; train.eval_batch_size, which a resume may change freely, must
    not choose them."""
    figures = [pretrain(pretrain_config(synthetic_data_dir, tmp_path / f"b{size}", train__max_steps=4,
                                        train__eval_batch_size=size), progress=False)["val"] for size in (4, 64)]
    assert figures[0] == figures[1]


def test_the_figures_are_means_over_every_predicted_token_of_a_step_or_of_the_held_out_texts(synthetic_data_dir,
                                                                                            tmp_path, monkeypatch):
    """Batches of unlike numbers of masked tokens: a step accumulated over micro-batches, and validation over
    several batches, each report the mean over all their predicted tokens, not a mean of the batches' means."""
    monkeypatch.setattr(pretrain_mod, "VAL_BATCH", 8)  # held-out windows a batch: 40 texts make several
    rt = make_runtime("cpu", "fp32")
    try:
        run = pretrain_mod.setup(pretrain_config(synthetic_data_dir, tmp_path / "run"), rt)
    finally:
        release_output_dirs()  # the output folder's lock, which pretrain() releases at its end

    def pooled(batches) -> dict[str, float]:  # each batch's figures, weighted by its predicted tokens
        with torch.no_grad():
            figures = [({"loss": loss.item(), **{k: v.item() for k, v in stats.items()}}, len(tensors[3]))
                       for tensors in batches for loss, stats in [run.model(*tensors)]]
        assert len(figures) > 1 and len({n for _, n in figures}) > 1
        return {k: sum(f[k] * n for f, n in figures) / sum(n for _, n in figures) for k in figures[0][0]}

    run.model.eval()
    held_out, _, _ = run.task.evaluate(run)
    expected = pooled(run.task.held_out(torch.Generator().manual_seed(0)))
    assert {k: held_out[k] for k in expected} == pytest.approx(expected, rel=1e-6)
    order = np.argsort(run.task.lengths)  # a batch of short windows and one of long ones
    torch.manual_seed(0)
    batches = [run.task.batch(rt, order[:3]), run.task.batch(rt, order[-6:])]
    expected = pooled(b.tensors for b in batches)  # tiny.toml has no dropout: the same figures in training mode
    run.model.train()
    result = loop.train_step(run, batches)
    assert result.stats == pytest.approx(expected, rel=1e-6)


def test_a_fine_tuned_run_that_lost_its_tokenizer_resumes_with_the_encoders(pretrained, synthetic_data_dir, tmp_path):
    """Not with one trained anew on the fine-tuning data, whose ids would index other embedding rows."""
    out, _ = pretrained
    ft = tmp_path / "ft"
    train(pretrain_config(synthetic_data_dir, ft, train__init_from=str(out), train__max_steps=2), progress=False)
    (ft / ckpt.TOKENIZER_FILE).unlink()
    train(pretrain_config(synthetic_data_dir, ft, train__init_from=str(out), train__max_steps=4), resume=True,
          force=True, progress=False)
    assert (ft / ckpt.TOKENIZER_FILE).read_text() == (out / ckpt.TOKENIZER_FILE).read_text()


@pytest.mark.parametrize("damage", ["missing", "a file", "no config", "no tokenizer", "truncated weights",
                                    "format version", "no encoder size", "another model"])
def test_a_bad_init_from_directory_is_one_clear_error(pretrained, synthetic_data_dir, tmp_path, damage):
    source, _ = pretrained
    bad = tmp_path / "bad"
    shutil.copytree(source, bad, ignore=shutil.ignore_patterns(ckpt.CKPT_DIR, "events.*"))
    expected = UsageError
    if damage == "missing":
        shutil.rmtree(bad)
    elif damage == "a file":
        shutil.rmtree(bad)
        bad.write_text("x")
    elif damage == "no config":
        (bad / ckpt.CONFIG_FILE).unlink()
        expected = TfmError
    elif damage == "no tokenizer":  # its ids would be another tokenizer's, trained on the fine-tuning data
        (bad / ckpt.TOKENIZER_FILE).unlink()
        expected = TfmError
    elif damage == "truncated weights":
        data = (bad / ckpt.MODEL_FILE).read_bytes()
        (bad / ckpt.MODEL_FILE).write_bytes(data[: len(data) // 2])
        expected = TfmError
    elif damage == "format version":
        meta = json.loads((bad / ckpt.CONFIG_FILE).read_text())
        (bad / ckpt.CONFIG_FILE).write_text(json.dumps({**meta, "format_version": 99}))
        expected = TfmError
    elif damage == "no encoder size":  # e.g. written before model.ff existed
        meta = json.loads((bad / ckpt.CONFIG_FILE).read_text())
        del meta["model"]["ff"]
        (bad / ckpt.CONFIG_FILE).write_text(json.dumps(meta))
        expected = TfmError
    else:
        weights = load_file(bad / ckpt.MODEL_FILE)
        del weights["encoder.norm.weight"]
        save_file(weights, bad / ckpt.MODEL_FILE)
        expected = TfmError

    def attempt():
        return train(pretrain_config(synthetic_data_dir, tmp_path / "ft", train__init_from=str(bad)), progress=False)

    with pytest.raises(expected) as info:
        attempt()
    assert type(info.value) is expected and "\n" not in str(info.value)
    assert not (tmp_path / "ft" / ckpt.MODEL_FILE).exists()


# --------------------------------------------------------------------------- where a classifier is expected


@pytest.mark.parametrize("command", [["evaluate"], ["predict", "a fine film"], ["inspect"],
                                     ["explain", "a fine film", "--html", "page.html"],
                                     ["pseudo-label", "-o", "labels.jsonl", "--split", "train"]], ids=lambda c: c[0])
def test_a_pretraining_output_given_for_a_classifier_says_what_it_is(pretrained, tmp_path, monkeypatch, command):
    from typer.testing import CliRunner

    from transformer_cli.cli import app

    out, _ = pretrained
    if command[0] == "inspect":
        pytest.importorskip("torchinfo")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [*command, "-c", str(out)])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line == (f"tfm: error: '{out}' holds a pretrained encoder written by `tfm pretrain`, not a classifier; "
                    f"fine-tune a classifier from it with `tfm train --init-from {out}`")
    assert list(tmp_path.iterdir()) == []


def test_a_pretraining_that_saved_no_model_yet_is_no_classifier_either(pretrained, tmp_path):
    import shutil

    from transformer_cli.evaluate import load_model_dir

    early = Path(shutil.copytree(pretrained[0], tmp_path / "early", ignore=shutil.ignore_patterns("*.safetensors")))
    with pytest.raises(UsageError, match="holds a pretrained encoder written by `tfm pretrain`, not a classifier"):
        load_model_dir(early)


@pytest.mark.parametrize("how", ["--resume", "--resume-from"])
@pytest.mark.parametrize("folder", ["pretrained", "trained_run"])
def test_resuming_the_other_commands_run_names_the_cause(request, synthetic_data_dir, tmp_path, folder, how):
    """tfm train on a pretraining's folder or checkpoint, and tfm pretrain on a classifier's: one line, with
    or without --force, and nothing of the folder touched."""
    import shutil

    run = Path(shutil.copytree(request.getfixturevalue(folder)[0], tmp_path / "run"))
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    if how == "--resume":
        cfg, resume = pretrain_config(synthetic_data_dir, run), True
    else:
        cfg, resume = pretrain_config(synthetic_data_dir, tmp_path / "new"), str(ckpt.checkpoint_dirs(run)[-1])
    command, message = {
        "pretrained": (train, (r"holds a pretrained encoder written by `tfm pretrain`, not a classifier; fine-tune a "
                               rf"classifier from it with `tfm train --init-from {re.escape(str(run))}` and another "
                               r"--output-dir; `tfm pretrain --resume` continues the pretraining")),
        "trained_run": (pretrain, (r"holds a classifier written by `tfm train`, not a pretraining run; pretrain into "
                                   r"another --output-dir")),
    }[folder]
    for force in (False, True):
        with pytest.raises(UsageError, match=message):
            command(cfg, resume=resume, force=force, progress=False)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before
    assert not (tmp_path / "new").exists()


def test_a_fresh_classifier_run_into_a_pretraining_folder_names_the_cause(pretrained, synthetic_data_dir, tmp_path):
    import shutil

    run = Path(shutil.copytree(pretrained[0], tmp_path / "pre"))
    with pytest.raises(UsageError, match="holds a pretrained encoder written by `tfm pretrain`, not a classifier"):
        train(pretrain_config(synthetic_data_dir, run), progress=False)
