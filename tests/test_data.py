import csv
import dataclasses
import json
import re
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import make_examples, read_jsonl, write_jsonl

from transformer_cli import data as data_mod
from transformer_cli.config import DataConfig
from transformer_cli.data import (
    BucketSampler,
    Encoded,
    collate,
    encode_texts,
    length_batches,
    load_splits,
    prepare_train_data,
    stratified_split,
    train_tokenizer,
    train_val_splits,
    truncate,
)
from transformer_cli.data import text as text_mod
from transformer_cli.data.text import characters
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.tokens import CLS_ID, PAD_ID, PAD_MULTIPLE, SPECIAL_TOKENS


def pairs(split) -> list[tuple[str, int]]:
    return list(zip(split.texts, split.labels.tolist()))


def words(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text)


@pytest.fixture(scope="session")
def train_texts(synthetic_data_dir) -> list[str]:
    return [r["text"] for r in read_jsonl(synthetic_data_dir / "train.jsonl")]


@pytest.fixture(scope="session")
def tokenizer(train_texts):
    return train_tokenizer(train_texts, DataConfig(vocab_size=500))


# --------------------------------------------------------------------------- split


@pytest.fixture
def imbalanced_labels() -> np.ndarray:
    return np.random.default_rng(0).permutation(np.array([0] * 60 + [1] * 140))


def test_stratified_split_keeps_label_proportions_and_covers_everything(imbalanced_labels):
    train, val = stratified_split(imbalanced_labels, 0.25, seed=3)
    assert Counter(imbalanced_labels[val].tolist()) == {0: 15, 1: 35}
    assert Counter(imbalanced_labels[train].tolist()) == {0: 45, 1: 105}
    assert not set(train) & set(val)
    assert sorted([*train, *val]) == list(range(len(imbalanced_labels)))
    few = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
    train, val = stratified_split(few, 0.01, seed=0)  # 1% of 2 rounds to none: each label still in both parts
    assert set(few[train]) == set(few[val]) == {0, 1}


def test_stratified_split_is_seeded(imbalanced_labels):
    a, b, c = (stratified_split(imbalanced_labels, 0.25, seed=s) for s in (3, 3, 4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1])


def test_stratified_split_is_the_draw_saved_runs_were_validated_on(imbalanced_labels):
    """`tfm evaluate --split validation` draws a run's validation part again from its seed: the draw must not change."""
    rng = np.random.default_rng(3)
    expected_val = []
    for label in (0, 1):
        idx = rng.permutation(np.flatnonzero(imbalanced_labels == label))
        expected_val.append(idx[: round(len(idx) * 0.25)])
    _, val = stratified_split(imbalanced_labels, 0.25, seed=3)
    assert np.array_equal(val, np.sort(np.concatenate(expected_val)))


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_a_folder_of_csv_or_tsv_files_reads_them_as_the_files_named_alone(tmp_path, suffix):
    """A TSV review may open with '"' (no quoting), and a CSV cell "NA" is text, in a folder too."""
    sep = "\t" if suffix == ".tsv" else ","
    first = '"Wow, what a film.' if suffix == ".tsv" else "NA"
    lines = ["text" + sep + "label", first + sep + "1", "bad one" + sep + "0", 'the acting" fine' + sep + "1"]
    folder = tmp_path / "reviews"
    folder.mkdir()
    (folder / f"train{suffix}").write_text("\n".join(lines) + "\n")
    for source in (str(folder), str(folder / f"train{suffix}")):
        d = data_mod.open_text_source(source)["train"]
        assert d["text"] == [first, "bad one", 'the acting" fine'], source


def test_a_folder_with_two_files_for_a_split_is_refused(tmp_path):
    folder = tmp_path / "reviews"
    (folder / "old").mkdir(parents=True)
    rows = make_examples(20, seed=0)
    for name in ("train.jsonl", "train_backup.jsonl", "old/train.jsonl"):
        write_jsonl(folder / name, rows)
    with pytest.raises(UsageError, match=r"has 3 files that `datasets` would join as split 'train': .*name them"):
        data_mod.open_dataset(str(folder))
    (folder / "train_backup.jsonl").unlink()
    (folder / "old" / "train.jsonl").unlink()
    assert len(data_mod.open_dataset(str(folder))["train"]) == 20


def test_a_named_split_training_would_not_read_is_refused(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", make_examples(40, seed=0))
    dev = write_jsonl(tmp_path / "dev.jsonl", make_examples(20, seed=1))
    cfg = DataConfig(source=f"train={train},dev={dev}", vocab_size=200, max_length=32)
    with pytest.raises(UsageError, match=r"names split 'dev', which training does not read.*validation=FILE, or set "
                                         r'data.val_split = "dev"'):
        train_val_splits(cfg, seed=0)
    assert len(train_val_splits(dataclasses.replace(cfg, val_split="dev"), seed=0)[1].texts) == 20
    test = write_jsonl(tmp_path / "test.jsonl", make_examples(20, seed=2))  # test is read later, by evaluate
    assert train_val_splits(dataclasses.replace(cfg, source=f"train={train},test={test}"), seed=0)[3] == ""


@pytest.mark.parametrize("text", ["", "   "])
def test_an_empty_review_in_a_labelled_split_is_refused_with_its_row(tmp_path, text):
    path = tmp_path / "train.csv"
    path.write_text(f"text,label\ngreat film,1\n{text},0\nawful,0\n")
    with pytest.raises(TfmError, match=r"has an empty or non-text value in column 'text' \(row 2\)"):
        load_splits(DataConfig(source=str(path)), ("train",))


# --------------------------------------------------------------------------- truncation and encoding


@pytest.mark.parametrize(
    ("n", "limit", "strategy", "expected"),
    [
        (20, 8, "head", [0, 1, 2, 3, 4, 5, 6, 7]),
        (20, 8, "head_tail", [0, 1, 14, 15, 16, 17, 18, 19]),  # a quarter from the start
        (20, 12, "head_tail", [0, 1, 2, 11, 12, 13, 14, 15, 16, 17, 18, 19]),
        (5, 8, "head_tail", [0, 1, 2, 3, 4]),
        (8, 8, "head", [0, 1, 2, 3, 4, 5, 6, 7]),
    ],
)
def test_truncate(n, limit, strategy, expected):
    assert truncate(list(range(n)), limit, strategy) == expected


def test_special_tokens_written_in_a_review_are_encoded_as_text(tokenizer):
    ids, offsets = encode_texts(tokenizer, ["great [PAD] film [CLS] fun [SEP]", "great film fun"], 64, "head")
    first, second = ids[offsets[0]:offsets[1]].tolist(), ids[offsets[1]:offsets[2]].tolist()
    assert first[0] == CLS_ID and not {PAD_ID, CLS_ID} & set(first[1:])  # only the [CLS] we put first
    assert len(first) > len(second) + 3  # the brackets and letters became tokens of their own


def ascii_text(rng, n_pieces: int) -> str:
    """ASCII text among what tokenization must get right: each kind of ASCII whitespace and the control
    characters that are not whitespace, every punctuation character, <br> tags with whitespace inside or in
    capitals, special tokens' text, digits, capitals, words the vocabulary lacks and words over WordPiece's
    length limit."""
    import string

    pieces = ["film", "Great", "MOVIE", "actor's", "don't", "fun!", "2.5/10", "<br />", "<br/>", "<br>", "<BR>",
              "<br\x0b/>", "<br\x1c/>", "<br\t\n >", "[CLS]", "[PAD]", "##", "qzxjv", "a\x00b", "\x7f",
              "x" * 100, "y" * 101, "e.g.", "...", "--", "(yes)", "$5", "~", "@home", "`a`", "re-make"]
    pieces += list(string.punctuation) + [c * 3 for c in string.punctuation]
    seps = [" ", " ", " ", "", "\t", "\n", "\r", "\x0b", "\x0c", "\x1c", "\x1f", "  "]
    return "".join(rng.choice(pieces) + rng.choice(seps) for _ in range(n_pieces))


def awkward_text(rng, n_pieces: int) -> str:
    """Text beyond ASCII: combining marks, compatibility characters, non-ASCII whitespace, accented and
    full-width letters, mixed with <br /> tags, special tokens' text and runs with no space."""
    pieces = ["film", "great", "Awful", "it's", "<br />", "<br \n\n />", "<BR>", "[CLS]", "[PAD]", ",", "!!",
              "e\u0301", "\u0301", "=\u0338", "\uff1c\uff42\uff52\uff1e", "\u00a0", "\u3000", "\u2000", "\x1c",
              "\r\n", "x" * 150, "word," * 30, ",\u0301", "!\u00e9", "caf\u00e9", "cr\u00e8me br\u00fbl\u00e9e",
              "\uff26\uff49\uff4c\uff4d", "\u2019quoted\u2019", "\u00bd", "Stra\u00dfe", "\u0130stanbul",
              "\u65e5\u672c\u8a9e", "\U0001f600", "a,b.c!d;e:f?" * 20]
    seps = [" ", " ", " ", "\n", "", "  ", "\t", "\u00a0"]
    return "".join(rng.choice(pieces) + rng.choice(seps) for _ in range(n_pieces))


def test_encode_texts_gives_the_tokenizers_own_ids_cut_as_truncate_cuts(tokenizer, train_texts, monkeypatch):
    """ASCII and non-ASCII texts, short and long, over several chunks of ENCODE_CHUNK texts: each row is
    [CLS] + what the tokenizer's own `encode` gives for the text alone (special tokens' text as text), cut
    by `truncate`, or whole with max_length None."""
    import random

    monkeypatch.setattr(text_mod, "ENCODE_CHUNK", 16)
    rng = random.Random(0)
    texts = [ascii_text(rng, rng.choice([1, 3, 30, 300])) for _ in range(60)]
    texts += [awkward_text(rng, rng.choice([1, 5, 60, 400])) for _ in range(60)]
    texts += train_texts[:30] + ["", " \t ", "\u00a0"]
    assert len(texts) > 5 * text_mod.ENCODE_CHUNK
    tokenizer.encode_special_tokens = True  # as encode_texts asks: special tokens' text is text
    whole = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    assert any(SPECIAL_TOKENS.index("[UNK]") in w for w in whole)  # words the vocabulary lacks were among them
    assert any(tokenizer.id_to_token(i).startswith("##") for w in whole for i in w)  # and words of several pieces
    for max_length, strategy in [(None, "head"), (9, "head"), (17, "head_tail"), (33, "head_tail"), (64, "head_tail")]:
        ids, offsets = encode_texts(tokenizer, texts, max_length, strategy)
        assert ids.dtype == np.int32 and len(offsets) == len(texts) + 1 and offsets[-1] == len(ids)
        if max_length is not None:  # some texts are cut, some are not
            assert 0 < sum(len(w) >= max_length for w in whole) < len(texts)
        for i, text in enumerate(texts):
            kept = whole[i] if max_length is None else truncate(whole[i], max_length - 1, strategy)
            assert ids[offsets[i] : offsets[i + 1]].tolist() == [CLS_ID, *kept], (max_length, strategy, text)
    assert encode_texts(tokenizer, [], 16, "head")[1].tolist() == [0]


def test_tokenizer_round_trip_lowercases_and_drops_br_tags(tokenizer, train_texts):
    for text in train_texts[:20]:
        expected = re.sub(r"<br\s*/?>", " ", text).lower()
        decoded = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids)
        assert "[UNK]" not in decoded
        assert words(decoded) == words(expected)


def test_tokenizer_reserves_the_special_ids(tokenizer):
    assert tokenizer.token_to_id("[PAD]") == PAD_ID
    assert tokenizer.token_to_id("[CLS]") == CLS_ID


TRAIN_IN_A_PROCESS = """
import json, sys
from transformer_cli.config import DataConfig
from transformer_cli.data import train_tokenizer
texts = json.load(open(sys.argv[1]))
print(train_tokenizer(texts, DataConfig(vocab_size=150)).to_str())
"""


def test_wordpiece_training_gives_the_same_tokenizer_in_every_process(train_texts, tmp_path):
    """`tokenizers`' own WordPiece trainer gives a different vocabulary in each process (its hash
    maps are seeded per process); 150 tokens leave ties between merges to break."""
    import subprocess
    import sys

    (tmp_path / "texts.json").write_text(json.dumps(train_texts))
    runs = {subprocess.run([sys.executable, "-c", TRAIN_IN_A_PROCESS, str(tmp_path / "texts.json")],
                           capture_output=True, text=True, check=True).stdout for _ in range(3)}
    assert len(runs) == 1
    assert json.loads(runs.pop()) == json.loads(train_tokenizer(train_texts, DataConfig(vocab_size=150)).to_str())


def test_only_the_special_tokens_are_special(tokenizer):
    assert [t.content for t in tokenizer.get_added_tokens_decoder().values()] == SPECIAL_TOKENS
    assert tokenizer.token_to_id("##e") is not None  # a continuation, an ordinary token: text never matches it
    assert tokenizer.encode("##e", add_special_tokens=False).tokens[-1] == "e"  # "#" splits off


def test_wordpiece_refuses_texts_it_cannot_read_twice(train_texts):
    with pytest.raises(TypeError, match="twice"):
        train_tokenizer(iter(train_texts), DataConfig(vocab_size=500), len(train_texts))


def test_characters_are_normalized():
    from tokenizers import normalizers

    normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    # "c" + a combining acute composes to one character; the ligature "fi" splits in two
    assert characters(["Ab, c\u0301d \ufb01!", "X\ty"], normalizer) == {"a", "b", ",", " ", "\u0107", "d", "f", "i",
                                                                      "!", "x", "\t", "y"}


def test_only_characters_that_continue_words_have_continuations():
    """Whitespace is in no word, and a word never continues with punctuation (a dash, an inverted question
    mark); a control character such as U+001C is neither."""
    vocab = train_tokenizer(["a, b. c\u2014d \u00bfe f\x1cg"] * 3, DataConfig(vocab_size=100)).get_vocab()
    assert {"a", ",", "\u2014", "\u00bf", "\x1c", "##b", "##\x1c"} <= vocab.keys()
    assert not {" ", "## ", "##,", "##.", "##\u2014", "##\u00bf"} & vocab.keys()


def test_the_alphabet_comes_before_the_continuations_as_the_trainer_orders_them(tokenizer):
    vocab = tokenizer.get_vocab()
    alphabet = sorted((i, t) for t, i in vocab.items() if len(t) == 1)
    continuations = sorted((i, t) for t, i in vocab.items() if t.startswith("##") and len(t) == 3)
    assert [i for i, _ in alphabet] == list(range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(alphabet)))
    assert [t for _, t in alphabet] == sorted(t for _, t in alphabet)  # by code point
    assert [t for _, t in continuations] == sorted(t for _, t in continuations)
    assert continuations[0][0] == alphabet[-1][0] + 1


# --------------------------------------------------------------------------- batching


@pytest.fixture
def lengths() -> np.ndarray:
    return np.random.default_rng(0).integers(1, 65, size=1001)


def flat(batches) -> list[int]:
    return [int(i) for b in batches for i in b]


def padded_tokens(batches, lengths) -> int:
    return sum(len(b) * int(lengths[b].max()) for b in batches)


def test_each_epoch_is_a_permutation_of_all_indices(lengths):
    sampler = BucketSampler(lengths, 16, seed=1)
    for epoch in range(3):
        batches = sampler.batches(epoch)
        assert sorted(flat(batches)) == list(range(len(lengths)))
        assert all(1 <= len(b) <= 16 for b in batches)


def test_bucketing_reduces_padding_against_random_batches(lengths):
    bucketed = BucketSampler(lengths, 16, seed=1).batches(0)
    order = np.random.default_rng(1).permutation(len(lengths))
    random_batches = [order[i : i + 16] for i in range(0, len(order), 16)]
    assert padded_tokens(bucketed, lengths) < 0.8 * padded_tokens(random_batches, lengths)


def test_batches_are_seeded_by_seed_and_epoch(lengths):
    def run(seed, epoch):
        return flat(BucketSampler(lengths, 16, seed=seed).batches(epoch))

    assert run(1, 0) == run(1, 0)
    assert run(1, 0) != run(1, 1)
    assert run(1, 0) != run(2, 0)


def test_ranks_split_each_global_batch_evenly(lengths):
    global_batches = BucketSampler(lengths, 16, seed=1).global_batches(2)
    ranks = [BucketSampler(lengths, 16, seed=1, world_size=2, rank=r).batches(2) for r in (0, 1)]
    even = [b for b in global_batches if len(b) % 2 == 0]
    assert len(even) < len(global_batches)  # 1001 examples: one odd trailing batch is dropped
    assert len(ranks[0]) == len(ranks[1]) == len(even)
    for a, b, g in zip(*ranks, even):
        assert len(a) == len(b) and not set(a) & set(b)
        assert sorted([*a, *b]) == sorted(g)
    seen = flat(ranks[0]) + flat(ranks[1])
    assert len(seen) == len(set(seen))


@pytest.mark.parametrize(("batch_size", "max_tokens"), [(16, None), (16, 256), (7, 64), (1000, 500), (3, 10)])
def test_length_batches_cut_indices_sorted_by_length_under_both_limits(lengths, batch_size, max_tokens):
    batches = length_batches(lengths, batch_size, max_tokens)
    order = flat(batches)
    assert order == np.argsort(lengths, kind="stable").tolist()  # every index once, by length, ties in order
    for i, b in enumerate(batches):
        assert 1 <= len(b) <= batch_size
        width = int(lengths[b].max())
        assert max_tokens is None or len(b) * width <= max_tokens or len(b) == 1  # a longer row alone
        if i + 1 < len(batches):  # full: the next row would break a limit
            grown = len(b) + 1
            assert grown > batch_size or (max_tokens is not None and grown * lengths[batches[i + 1][0]] > max_tokens)


def test_length_batches_put_a_row_over_the_token_budget_alone_and_take_empty_input():
    lengths = np.array([5, 100, 3, 5, 60])
    assert [b.tolist() for b in length_batches(lengths, 8, max_tokens=50)] == [[2, 0, 3], [4], [1]]
    assert [b.tolist() for b in length_batches(lengths, 2)] == [[2, 0], [3, 4], [1]]
    assert length_batches(np.zeros(0, dtype=np.int64), 8) == length_batches(np.zeros(0, dtype=np.int64), 8, 64) == []


def test_collate_pads_with_pad_id_and_masks_real_tokens():
    rows = [[CLS_ID, 7, 8], [CLS_ID], [CLS_ID, 5, 6, 9, 11]]
    offsets = np.cumsum([0, *map(len, rows)])
    enc = Encoded(np.array([t for r in rows for t in r], dtype=np.int32), offsets, np.array([1, 0, 1]))
    idx = np.array([2, 0, 1])
    ids, mask, labels = collate(enc, idx)
    assert ids.shape == mask.shape == (3, 5)
    for out_row, i in enumerate(idx):
        n = len(rows[i])
        assert ids[out_row, :n].tolist() == rows[i]
        assert (ids[out_row, n:] == PAD_ID).all()
        assert mask[out_row].tolist() == [True] * n + [False] * (5 - n)
    assert labels.tolist() == [1, 1, 0]


@pytest.mark.parametrize(("longest", "split_longest", "width"), [
    (5, 64, 32), (32, 64, 32), (33, 64, 64), (33, 40, 40), (40, 40, 40), (2, 2, 2), (65, 1024, 96)])
def test_collate_rounds_the_width_up_to_a_multiple_of_32_within_the_splits_longest(longest, split_longest, width):
    # row 2 is not in the batch
    rows = [[CLS_ID] + [7] * (longest - 1), [CLS_ID, 5], [CLS_ID] + [9] * (split_longest - 1)]
    enc = Encoded(np.array([t for r in rows for t in r], dtype=np.int32), np.cumsum([0, *map(len, rows)]),
                  np.array([0, 1, 0]))
    ids, mask, _ = collate(enc, np.array([0, 1]))
    assert PAD_MULTIPLE == 32 and ids.shape == mask.shape == (2, width)
    assert mask.sum(1).tolist() == [longest, 2] and (ids[~mask] == PAD_ID).all()


# --------------------------------------------------------------------------- loading


def cfg_for(source) -> DataConfig:
    return DataConfig(source=str(source))


def write_csv(path: Path, rows: list[dict], columns=("text", "label")) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows([[r["text"], r["label"]] for r in rows])
    return path


@pytest.fixture
def csv_rows() -> list[dict]:
    rows = make_examples(12, seed=5)
    rows[0]["text"] = 'with, commas and "quotes"'
    return rows


def test_load_jsonl_folder(synthetic_data_dir):
    splits, labels = load_splits(cfg_for(synthetic_data_dir), ("train", "test"))
    assert labels == ["neg", "pos"]
    for name in ("train", "test"):
        expected = [(r["text"], r["label"]) for r in read_jsonl(synthetic_data_dir / f"{name}.jsonl")]
        assert pairs(splits[name]) == expected
        assert splits[name].labels.dtype == np.int64


def test_a_dataset_folder_or_id_is_loaded_without_remote_code(synthetic_data_dir, monkeypatch):
    import datasets

    calls = []
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    load_splits(cfg_for(synthetic_data_dir), ("train",))
    assert calls == [{"trust_remote_code": False}]


def test_load_single_csv_becomes_train(tmp_path, csv_rows):
    path = write_csv(tmp_path / "reviews.csv", csv_rows)
    splits, _ = load_splits(cfg_for(path), ("train",))
    assert pairs(splits["train"]) == [(r["text"], r["label"]) for r in csv_rows]
    with pytest.raises(UsageError, match="no 'test' split"):
        load_splits(cfg_for(path), ("test",))


def test_a_tsv_is_read_unquoted_so_a_review_may_open_with_a_quote(tmp_path):
    path = tmp_path / "reviews.tsv"
    path.write_text('text\tlabel\n"The Matrix" is great\t1\nawful\t0\n"Best movie ever. 10/10\t1\nbad film\t0\n',
                    encoding="utf-8")
    splits, _ = load_splits(cfg_for(path), ("train",))
    assert pairs(splits["train"]) == [('"The Matrix" is great', 1), ("awful", 0), ('"Best movie ever. 10/10', 1),
                                      ("bad film", 0)]


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_cells_that_look_missing_stay_text(tmp_path, suffix):
    sep = "," if suffix == ".csv" else "\t"
    path = tmp_path / f"reviews{suffix}"
    path.write_text(f"text{sep}label\nit is a movie{sep}None\nNA{sep}positive\nnull{sep}NA\n", encoding="utf-8")
    splits, names = load_splits(cfg_for(path), ("train",))
    assert names == ["NA", "None", "positive"]
    assert [(t, names[y]) for t, y in pairs(splits["train"])] == [("it is a movie", "None"), ("NA", "positive"),
                                                                   ("null", "NA")]


def test_load_named_files(tmp_path, csv_rows):
    a = write_csv(tmp_path / "a.csv", csv_rows[:8])
    b = write_csv(tmp_path / "b.csv", csv_rows[8:])
    splits, _ = load_splits(cfg_for(f"train={a},test={b}"), ("train", "test"))
    assert pairs(splits["train"]) == [(r["text"], r["label"]) for r in csv_rows[:8]]
    assert pairs(splits["test"]) == [(r["text"], r["label"]) for r in csv_rows[8:]]


def test_a_split_named_twice_is_refused_not_half_read(tmp_path, csv_rows):
    a = write_csv(tmp_path / "a.csv", csv_rows[:8])
    b = write_csv(tmp_path / "b.csv", csv_rows[8:])
    with pytest.raises(UsageError, match="names split train more than once"):
        load_splits(cfg_for(f"train={a},train={b}"), ("train",))


@pytest.mark.parametrize("content", ["", "\n  \n"], ids=["empty", "blank"])
def test_an_empty_file_in_a_dataset_folder_is_named(tmp_path, content):
    write_jsonl(tmp_path / "train.jsonl", make_examples(20, seed=1))
    (tmp_path / "test.jsonl").write_text(content, encoding="utf-8")
    with pytest.raises(TfmError, match=f"data file '{tmp_path / 'test.jsonl'}' is empty: fill it or remove it") as e:
        load_splits(cfg_for(tmp_path), ("train",))
    assert not isinstance(e.value, UsageError)  # what a file holds is a runtime error (exit 1), not a usage one


@pytest.mark.parametrize(("name", "content", "message"), [
    ("u.jsonl", "", "is empty"),
    ("u.csv", "text,label\n", "has a header line but no rows"),
    ("u.parquet", None, "has no rows"),
], ids=["jsonl", "csv-header", "parquet"])
def test_a_data_file_without_rows_is_named(tmp_path, name, content, message):
    """Named files, and a folder's (a split of a README's configs): the file and what to do, not datasets'
    "StopIteration" or "corresponds to no data"."""
    path = tmp_path / name
    if content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": pa.array([], pa.string()), "label": pa.array([], pa.int64())}), path)
    else:
        path.write_text(content, encoding="utf-8")
    for source in (f"test={path}", str(path)):
        with pytest.raises(TfmError, match=f"data file '{re.escape(str(path))}' {message}: fill it or remove it") as e:
            data_mod.open_text_source(source)
        assert not isinstance(e.value, UsageError)
    from datasets import Dataset

    folder = tmp_path / "folder"
    folder.mkdir()
    train = folder / f"train{path.suffix}"
    getattr(Dataset.from_list(make_examples(20, seed=1)), f"to_{path.suffix[1:].replace('jsonl', 'json')}")(train)
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n"
                                      f"  - {{split: train, path: {train.name}}}\n"
                                      f"  - {{split: unsupervised, path: ../{name}}}\n---\n", encoding="utf-8")
    with pytest.raises(TfmError, match=f"{message}: fill it or remove it"):
        data_mod.open_text_source(str(folder))


def test_empty_files_that_are_no_split_of_a_dataset_folder_do_not_matter(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", make_examples(20, seed=1))
    (tmp_path / "notes.txt").write_text("", encoding="utf-8")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "train-checkpoint.jsonl").write_text("", encoding="utf-8")
    splits, _ = load_splits(cfg_for(tmp_path), ("train",))
    assert len(splits["train"]) == 20


def test_an_unreadable_dataset_folder_is_not_told_to_pass_a_local_copy(tmp_path):
    (tmp_path / "train.jsonl").write_text("{not json\n", encoding="utf-8")
    with pytest.raises(TfmError, match="check its data files") as e:
        load_splits(cfg_for(tmp_path), ("train",))
    assert "local copy" not in str(e.value)


def test_a_file_not_in_utf8_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("text,label\ncafé great,1\nawful café,0\n".encode("latin-1"))
    with pytest.raises(TfmError, match="codec can't decode .*; save the file as UTF-8$"):
        load_splits(cfg_for(path), ("train",))


def test_a_label_column_of_distinct_values_is_named(tmp_path):
    """The text column given as the labels: every review its own class, refused before any split."""
    rows = make_examples(300, seed=3)
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = DataConfig(source=str(path), label_column="text")
    with pytest.raises(TfmError, match="column 'text' .* has 300 distinct values in 300 examples; set data.label_col"):
        train_val_splits(cfg, seed=0)
    few = write_jsonl(tmp_path / "few.jsonl", [{"text": f"review {i}", "label": i % 3} for i in range(12)])
    train, val, names, _ = train_val_splits(DataConfig(source=str(few), val_size=0.5), seed=0)  # few, not distinct
    assert names == ["0", "1", "2"] and len(train) + len(val) == 12


def test_a_file_datasets_does_not_take_as_a_split_is_named_with_what_to_do(tmp_path, csv_rows):
    """unsupervised.csv beside train.csv and test.csv, no README: `datasets` takes only train, test and
    validation by their file names, so the error says why the file was not read and how to name it."""
    for name, rows in (("train", csv_rows[:6]), ("test", csv_rows[6:]), ("unsupervised", csv_rows)):
        write_csv(tmp_path / f"{name}.csv", rows)
    named = f"train={tmp_path / 'train.csv'},unsupervised={tmp_path / 'unsupervised.csv'}"
    hint = re.escape(f"did not read {tmp_path / 'unsupervised.csv'} as split 'unsupervised': name the files "
                     f"instead (--data {named}), or add a README.md whose configs: section")
    with pytest.raises(UsageError, match=r"has no 'unsupervised' split \(it has: train, test\); .*" + hint):
        load_splits(cfg_for(tmp_path), ("train", "unsupervised"))
    with pytest.raises(UsageError, match=r"data.val_split = 'unsupervised': .* has no such split; .*" + hint):
        train_val_splits(dataclasses.replace(cfg_for(tmp_path), val_split="unsupervised"), seed=0)
    splits, _ = load_splits(cfg_for(named), ("train", "unsupervised"))  # what it says to do
    assert pairs(splits["unsupervised"]) == [(r["text"], r["label"]) for r in csv_rows]
    with pytest.raises(UsageError, match=r"has no 'dev' split \(it has: train, test\)$"):  # no file of that name
        load_splits(cfg_for(tmp_path), ("dev",))


def test_optional_splits_are_loaded_when_the_dataset_has_them(tmp_path, csv_rows):
    a = write_csv(tmp_path / "a.csv", csv_rows[:8])
    b = write_csv(tmp_path / "b.csv", csv_rows[8:])
    splits, _ = load_splits(cfg_for(f"train={a},validation={b}"), ("train",), ("validation", "dev"))
    assert sorted(splits) == ["train", "validation"]  # no 'dev': skipped, not an error
    assert pairs(splits["validation"]) == [(r["text"], r["label"]) for r in csv_rows[8:]]
    splits, _ = load_splits(cfg_for(a), ("train",), ("validation",))  # one file: train only
    assert sorted(splits) == ["train"]


ACL_FILES = {
    "train/pos/0_9.txt": "Superb film.<br />Loved it",
    "train/pos/1_8.txt": "wonderful acting",
    "train/neg/0_2.txt": "awful, boring",
    "train/neg/1_1.txt": "hated every minute",
    "test/pos/0_10.txt": "great fun",
    "test/neg/0_3.txt": "terrible ending",
}


def expected_acl(split: str) -> list[tuple[str, int]]:
    return sorted((text, int("/pos/" in name)) for name, text in ACL_FILES.items() if name.startswith(split))


@pytest.fixture
def acl_root(tmp_path) -> Path:
    for name, text in ACL_FILES.items():
        path = tmp_path / "aclImdb" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (tmp_path / "aclImdb" / "train" / "unsup").mkdir()  # present in the real archive; ignored
    (tmp_path / "aclImdb" / "train" / "unsup" / "0_0.txt").write_text("unlabelled")
    (tmp_path / "aclImdb" / "train" / "pos" / "._1_7.txt").write_bytes(b"\x00\x05Mac OS X")  # no review
    return tmp_path


@pytest.fixture
def acl_tarball(acl_root, tmp_path) -> Path:
    path = tmp_path / "aclImdb_v1.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(acl_root / "aclImdb", arcname="aclImdb")
    return path


@pytest.mark.parametrize("where", ["parent", "aclImdb", "tarball"])
def test_load_aclimdb(acl_root, acl_tarball, where):
    source = {"parent": acl_root, "aclImdb": acl_root / "aclImdb", "tarball": acl_tarball}[where]
    splits, labels = load_splits(cfg_for(source), ("train", "test"))
    assert labels == ["neg", "pos"]
    for split in ("train", "test"):
        assert sorted(pairs(splits[split])) == expected_acl(split)
    optional, _ = load_splits(cfg_for(source), ("train",), ("test", "validation"))  # what it has of them
    assert sorted(optional) == ["test", "train"] and sorted(pairs(optional["test"])) == expected_acl("test")
    with pytest.raises(UsageError, match="has only the splits train, test, unsupervised, not 'unsup'"):
        load_splits(cfg_for(source), ("unsup",))


@pytest.mark.parametrize("where", ["parent", "aclImdb", "tarball"])
def test_aclimdb_as_a_text_source_has_the_hubs_splits(acl_root, acl_tarball, where):
    """`tfm pretrain` and `tfm pseudo-label` read aclImdb as they read the Hub's copy: train and test (pos
    and neg), and unsupervised (train/unsup), as text."""
    source = str({"parent": acl_root, "aclImdb": acl_root / "aclImdb", "tarball": acl_tarball}[where])
    d = data_mod.open_text_source(source)
    assert sorted(d) == ["test", "train", "unsupervised"]
    for split in ("train", "test"):
        assert sorted(d[split]["text"]) == sorted(text for text, _ in expected_acl(split))
    assert d["unsupervised"]["text"] == ["unlabelled"] and d["unsupervised"]["label"] == [-1]  # as the Hub's
    assert sorted(zip(d["train"]["text"], d["train"]["label"])) == expected_acl("train")
    files = data_mod.source_files(source)  # what an output must not overwrite
    assert files == [acl_tarball] if where == "tarball" else len(files) == len(ACL_FILES) + 1


@pytest.mark.parametrize("where", ["aclImdb", "tarball"])
def test_aclimdb_as_a_text_source_reads_only_the_splits_asked_for(acl_root, acl_tarball, where, monkeypatch):
    """Pretraining reads unsupervised and train: aclImdb's test reviews are never opened."""
    source = str({"aclImdb": acl_root / "aclImdb", "tarball": acl_tarball}[where])
    opened = []
    read_text, extractfile = Path.read_text, tarfile.TarFile.extractfile
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: opened.append(str(self)) or read_text(self, *a, **k))
    monkeypatch.setattr(tarfile.TarFile, "extractfile",
                        lambda self, m: opened.append(getattr(m, "name", m)) or extractfile(self, m))
    d = data_mod.open_text_source(source, ("unsupervised", "train"))
    assert sorted(d) == ["train", "unsupervised"]
    assert sorted(d["train"]["text"]) == sorted(text for text, _ in expected_acl("train"))
    assert len(opened) == len(expected_acl("train")) + 1  # the train reviews and the one unlabelled review
    assert not any("/test/" in name for name in opened)


@pytest.mark.parametrize("source", ["{tmp}/missing", "{tmp}/missing.csv", "./no/such/folder", "nope.jsonl"])
def test_missing_path_is_a_usage_error(tmp_path, source):
    with pytest.raises(UsageError, match="does not exist"):
        load_splits(cfg_for(source.format(tmp=tmp_path)), ("train",))


def test_missing_columns_are_named(tmp_path, csv_rows):
    path = write_csv(tmp_path / "r.csv", csv_rows, columns=("review", "sentiment"))
    with pytest.raises(TfmError) as e:
        load_splits(cfg_for(path), ("train",))
    assert "'text'" in str(e.value) and "'label'" in str(e.value) and "review" in str(e.value)


def test_a_label_the_train_split_lacks_is_refused(tmp_path, csv_rows):
    a = write_csv(tmp_path / "a.csv", csv_rows[:8])
    csv_rows[9]["label"] = 2
    b = write_csv(tmp_path / "b.csv", csv_rows[8:])
    with pytest.raises(TfmError, match=r"split 'test' of .* has label '2', which is not one of the classes trained on "
                                       r"\(neg, pos\)"):
        load_splits(cfg_for(f"train={a},test={b}"), ("train", "test"))


# --------------------------------------------------------------------------- the pipeline and its cache


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of the test's own (TFM_CACHE)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("TFM_CACHE", str(path))
    return path


@pytest.fixture
def data_cfg(synthetic_data_dir, cache) -> DataConfig:
    return DataConfig(source=str(synthetic_data_dir), vocab_size=500, max_length=32)


def cache_entries(cache: Path) -> dict[str, tuple[int, int]]:
    """{file name: (inode, mtime)} of the cache: an entry written again (atomically, by a rename) changes both."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.iterdir()}


def assert_same_prepared(a, b) -> None:
    assert a.tokenizer.to_str() == b.tokenizer.to_str()
    assert a.labels == b.labels
    for x, y in ((a.train, b.train), (a.val, b.val)):
        for field in ("ids", "offsets", "labels"):
            assert np.array_equal(getattr(x, field), getattr(y, field)), field


def test_prepare_train_data_holds_out_a_stratified_validation_split(data_cfg):
    prepared = prepare_train_data(data_cfg, seed=0)
    assert (len(prepared.train), len(prepared.val)) == (360, 40)
    assert prepared.val.labels.sum() == 20  # 400 balanced examples, 10% held out per label
    assert prepared.train.lengths.max() <= data_cfg.max_length


@pytest.fixture
def with_validation_dir(synthetic_data_dir, tmp_path) -> Path:
    """The synthetic data plus a validation split of its own (60 reviews)."""
    root = tmp_path / "with-validation"
    root.mkdir()
    for name in ("train", "test"):
        (root / f"{name}.jsonl").write_bytes((synthetic_data_dir / f"{name}.jsonl").read_bytes())
    write_jsonl(root / "validation.jsonl", make_examples(60, seed=3))
    return root


def test_a_datasets_own_validation_split_is_validated_on(with_validation_dir, data_cfg):
    cfg = dataclasses.replace(data_cfg, source=str(with_validation_dir))
    prepared = prepare_train_data(cfg, seed=0)
    assert (len(prepared.train), len(prepared.val)) == (400, 60)  # all of train; the split as it is
    assert prepared.val_split == "validation"
    val_rows = read_jsonl(with_validation_dir / "validation.jsonl")
    assert prepared.val.labels.tolist() == [r["label"] for r in val_rows]
    expected, _ = encode_texts(prepared.tokenizer, [r["text"] for r in val_rows], cfg.max_length, cfg.truncation)
    assert np.array_equal(prepared.val.ids, expected)
    # what `tfm evaluate --split validation` reads for this run
    again = data_mod.prepare_eval_data(cfg, prepared.tokenizer, "validation", None, seed=0)
    assert np.array_equal(again.ids, prepared.val.ids) and np.array_equal(again.labels, prepared.val.labels)

    subset = prepare_train_data(dataclasses.replace(cfg, max_eval_samples=25, max_train_samples=100), seed=0)
    assert (len(subset.train), len(subset.val)) == (100, 25)
    held_out = prepare_train_data(dataclasses.replace(cfg, val_split=""), seed=0)  # "" = hold out of train
    assert_same_prepared(held_out, prepare_train_data(data_cfg, seed=0))


def test_a_named_validation_split_the_dataset_lacks_is_refused(data_cfg):
    with pytest.raises(UsageError, match=r"data.val_split = 'dev': .* has no such split; name one it has, or set"):
        prepare_train_data(dataclasses.replace(data_cfg, val_split="dev"), seed=0)
    assert prepare_train_data(data_cfg, seed=0).val_split == ""  # the default: held out when the dataset has none


def test_an_unusable_validation_split_says_how_to_do_without(with_validation_dir, data_cfg):
    write_jsonl(with_validation_dir / "validation.jsonl", [{"text": "a", "label": -1}, {"text": "b", "label": 0}])
    cfg = dataclasses.replace(data_cfg, source=str(with_validation_dir))
    with pytest.raises(TfmError, match=r"has label '-1', which is not one of .* \(or set data.val_split = \"\" to "
                                       "validate on part of train"):
        prepare_train_data(cfg, seed=0)
    assert len(prepare_train_data(dataclasses.replace(cfg, val_split=""), seed=0).val) == 40


def test_second_prepare_hits_the_cache(data_cfg, cache):
    first = prepare_train_data(data_cfg, seed=0)
    entries = cache_entries(cache)
    assert sorted(name.split("-")[0] for name in entries) == ["encoded", "encoded", "tokenizer"]
    assert_same_prepared(prepare_train_data(data_cfg, seed=0), first)
    assert cache_entries(cache) == entries  # read, not made and written again


def test_changed_max_length_reuses_the_tokenizer_but_reencodes(data_cfg, cache):
    first = prepare_train_data(data_cfg, seed=0)
    entries = cache_entries(cache)
    shorter = prepare_train_data(dataclasses.replace(data_cfg, max_length=8), seed=0)
    assert shorter.tokenizer.to_str() == first.tokenizer.to_str()
    assert shorter.train.lengths.max() == 8 < first.train.lengths.max()
    now = cache_entries(cache)
    assert {k: v for k, v in now.items() if k.startswith("tokenizer")} == {
        k: v for k, v in entries.items() if k.startswith("tokenizer")}  # not trained again
    assert len(now) == len(entries) + 2 and entries.items() <= now.items()  # train and validation encoded anew


def test_train_max_length_cuts_the_training_reviews_only(data_cfg):
    """Training reviews are encoded as at max_length=train_max_length (the same cut, head and tail);
    validation keeps max_length."""
    whole = prepare_train_data(data_cfg, seed=0)
    cut = prepare_train_data(dataclasses.replace(data_cfg, train_max_length=8), seed=0)
    short = prepare_train_data(dataclasses.replace(data_cfg, max_length=8), seed=0)
    assert cut.train.lengths.max() == 8 < whole.train.lengths.max()
    for field in ("ids", "offsets", "labels"):
        assert np.array_equal(getattr(cut.train, field), getattr(short.train, field)), field
        assert np.array_equal(getattr(cut.val, field), getattr(whole.val, field)), field


@pytest.mark.parametrize("change", [{"truncation": "head"}, {"vocab_size": 100},
                                    {"long_text": "windows"}], ids=lambda c: next(iter(c)))
def test_a_changed_setting_is_not_served_from_the_cache(data_cfg, tmp_path, monkeypatch, change):
    """Prepared beside the cache of the same data under other settings, the result is what a fresh
    cache gives: every setting that changes the tokenizer or the encoding is part of its cache key."""
    short = dataclasses.replace(data_cfg, max_length=16)  # reviews are cut, so the cut's settings matter
    first = prepare_train_data(short, seed=0)
    changed = prepare_train_data(dataclasses.replace(short, **change), seed=0)
    monkeypatch.setenv("TFM_CACHE", str(tmp_path / "fresh"))
    fresh = prepare_train_data(dataclasses.replace(short, **change), seed=0)
    assert_same_prepared(changed, fresh)
    assert not (np.array_equal(changed.train.ids, first.train.ids)
                and changed.tokenizer.to_str() == first.tokenizer.to_str())  # the setting did change the result


def test_max_train_samples_subsamples(data_cfg):
    prepared = prepare_train_data(dataclasses.replace(data_cfg, max_train_samples=50), seed=0)
    assert len(prepared.train) == 50 and len(prepared.val) == 40


def test_a_single_label_is_refused(tmp_path):
    rows = [{"text": f"text number {i}", "label": 0} for i in range(20)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(TfmError, match=r"has only one class \(0\); a classifier needs examples of at least two"):
        prepare_train_data(DataConfig(source=str(tmp_path / "train.jsonl")), seed=0)


def test_encoded_subset_keeps_the_chosen_reviews_in_the_given_order():
    lengths = [3, 1, 4, 2]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    enc = Encoded(np.arange(offsets[-1], dtype=np.int32), offsets, np.array([0, 1, 0, 1]))
    sub = enc.subset(np.array([2, 0]))
    assert sub.lengths.tolist() == [4, 3] and sub.labels.tolist() == [0, 0]
    assert sub.ids.tolist() == [4, 5, 6, 7, 0, 1, 2]
    assert len(enc.subset(np.array([], dtype=np.int64))) == 0
