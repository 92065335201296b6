"""Shared fixtures: an offline environment, a synthetic sentiment dataset, tiny configs, one trained model."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"

POSITIVE = ["great", "wonderful", "loved", "superb"]
NEGATIVE = ["awful", "boring", "hated", "terrible"]
NEUTRAL = [
    "the", "a", "movie", "film", "plot", "actor", "actress", "scene", "story", "director", "camera", "music",
    "script", "character", "ending", "minutes", "watched", "saw", "it", "was", "and", "of", "to", "in", "with",
    "this", "that", "some", "very", "quite", "rather", "about", "their", "cinema", "time", "people", "picture",
    "sequel", "city", "night", "house", "family", "friend", "car", "dog", "summer",
]

_session_tmp: str | None = None


def pytest_configure(config):
    """Keep every cache in a throwaway folder and forbid network access, for the whole test run.

    Set in os.environ (not via monkeypatch) so that `datasets`, which reads its cache location when
    first imported, and subprocesses started by tests see the same settings.
    """
    global _session_tmp
    _session_tmp = tempfile.mkdtemp(prefix="tfm-tests-")
    root = Path(_session_tmp)
    os.environ.update({
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(root / "hf"),
        "HF_DATASETS_CACHE": str(root / "hf" / "datasets"),
        "TFM_CACHE": str(root / "tfm-cache"),
        "TOKENIZERS_PARALLELISM": "false",
        # one torch thread a process: pytest-xdist's workers share the cores, and OpenMP threads that spin
        # waiting for work would take each other's time slices (docs/training.md, threads)
        "OMP_NUM_THREADS": "1",
    })
    os.environ.pop("TFM_DATA", None)  # the CLI reads --data from it


def pytest_unconfigure(config):
    if _session_tmp is not None:
        shutil.rmtree(_session_tmp, ignore_errors=True)


# --------------------------------------------------------------------------- synthetic data


def make_review(rng: random.Random, label: int, n_words: int | None = None) -> str:
    """Neutral filler with a few words of the label's sentiment, mixed case and <br /> tags."""
    n_words = n_words if n_words is not None else rng.randint(6, 40)
    words = [rng.choice(NEUTRAL) for _ in range(n_words)]
    for _ in range(rng.randint(2, 4)):
        words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if label else NEGATIVE))
    words = [w.upper() if rng.random() < 0.1 else w.capitalize() if rng.random() < 0.2 else w for w in words]
    if rng.random() < 0.5:
        words.insert(rng.randrange(1, len(words)), "<br /><br />")
    return " ".join(words) + rng.choice([".", "!", "..."])


def make_examples(n: int, seed: int) -> list[dict]:
    """n examples, half of each label, in random order; about 5% are long enough to be truncated."""
    rng = random.Random(seed)
    labels = [i % 2 for i in range(n)]
    rng.shuffle(labels)
    return [
        {"text": make_review(rng, y, rng.randint(70, 110) if rng.random() < 0.05 else None), "label": y}
        for y in labels
    ]


MIXED = ["okay", "average", "decent", "fine"]  # the words of the third class of make_three_class_examples
THREE_CLASSES = ["negative", "neutral", "positive"]


def make_three_class_examples(n: int, seed: int) -> list[dict]:
    """n reviews labelled by name, a third of each of THREE_CLASSES, in random order: negative and
    positive ones as make_review writes them, neutral ones with a few MIXED words instead."""
    rng = random.Random(seed)
    labels = [THREE_CLASSES[i % 3] for i in range(n)]
    rng.shuffle(labels)
    rows = []
    for label in labels:
        if label == "neutral":
            words = [rng.choice(NEUTRAL) for _ in range(rng.randint(6, 40))]
            for _ in range(rng.randint(2, 4)):
                words.insert(rng.randrange(len(words) + 1), rng.choice(MIXED))
            text = " ".join(words) + "."
        else:
            text = make_review(rng, int(label == "positive"))
        rows.append({"text": text, "label": label})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="session")
def synthetic_data_dir(tmp_path_factory) -> Path:
    """A Hub-layout folder with train.jsonl (400 reviews) and test.jsonl (200); do not modify it."""
    root = tmp_path_factory.mktemp("synthetic")
    write_jsonl(root / "train.jsonl", make_examples(400, seed=1))
    write_jsonl(root / "test.jsonl", make_examples(200, seed=2))
    return root


UNLABELLED_README = """---
configs:
- config_name: default
  data_files:
  - {split: train, path: train.jsonl}
  - {split: test, path: test.jsonl}
  - {split: unsupervised, path: unsupervised.jsonl}
---
"""


@pytest.fixture(scope="session")
def unlabelled_data_dir(synthetic_data_dir, tmp_path_factory) -> Path:
    """IMDB's Hub layout: synthetic_data_dir's train and test, and an `unsupervised` split of 60 reviews
    without labels, the splits named in README.md as the Hub's copy names them; do not modify it."""
    root = tmp_path_factory.mktemp("unlabelled")
    for name in ("train.jsonl", "test.jsonl"):
        shutil.copyfile(synthetic_data_dir / name, root / name)
    write_jsonl(root / "unsupervised.jsonl", [{"text": row["text"]} for row in make_examples(60, seed=3)])
    (root / "README.md").write_text(UNLABELLED_README, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def test_rows(synthetic_data_dir) -> list[dict]:
    return read_jsonl(synthetic_data_dir / "test.jsonl")


# --------------------------------------------------------------------------- configs and a trained model


def tiny_config(data_dir: Path, output_dir: Path, **overrides):
    """configs/tiny.toml on the synthetic data, on the CPU; `overrides` are dotted keys with '__'
    for '.', e.g. train__max_steps=5."""
    from transformer_cli.config import load_config

    values = {"data.source": str(data_dir), "train.output_dir": str(output_dir), "train.device": "cpu",
              "train.precision": "fp32"}
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config(CONFIGS / "tiny.toml", values)


@pytest.fixture
def tiny_cfg(synthetic_data_dir, tmp_path):
    """The tiny recipe writing to a fresh folder under tmp_path (which does not exist yet)."""
    return tiny_config(synthetic_data_dir, tmp_path / "run")


@pytest.fixture(scope="session")
def trained_run(synthetic_data_dir, tmp_path_factory) -> tuple[Path, dict]:
    """(output directory, metrics) of one tiny training run, shared by tests that only read it.

    It keeps all its checkpoints; otherwise it is `tiny_cfg`.
    """
    from transformer_cli.training import loop
    from transformer_cli.training.classify import train

    out = tmp_path_factory.mktemp("trained") / "run"
    keep, loop.KEEP_CHECKPOINTS = loop.KEEP_CHECKPOINTS, 100
    try:
        metrics = train(tiny_config(synthetic_data_dir, out), progress=False)
    finally:
        loop.KEEP_CHECKPOINTS = keep
    return out, metrics


@pytest.fixture(scope="session")
def trained_dir(trained_run) -> Path:
    return trained_run[0]


@pytest.fixture
def model_dir(trained_dir, tmp_path) -> Path:
    """A private copy of the trained model directory (no checkpoints), free to change or damage."""
    return Path(shutil.copytree(trained_dir, tmp_path / "model", ignore=shutil.ignore_patterns("checkpoints")))


def edit_config(model_dir: Path, **changes) -> None:
    """Replace top-level entries of a model directory's config.json."""
    meta = json.loads((model_dir / "config.json").read_text())
    meta.update(changes)
    (model_dir / "config.json").write_text(json.dumps(meta))


# --------------------------------------------------------------------------- the reference inference path


def one_at_a_time_logits(model, enc):
    """The reference for every batched inference path: each review of an `Encoded` split alone,
    batch of one, no padding, no mask doing any work. `model` is any callable (ids, mask) -> logits."""
    import numpy as np
    import torch

    rows = []
    with torch.no_grad():
        for i in range(len(enc)):
            ids = torch.from_numpy(enc.ids[enc.offsets[i] : enc.offsets[i + 1]].astype(np.int64))[None]
            rows.append(model(ids, torch.ones_like(ids, dtype=torch.bool))[0])
    return torch.stack(rows).double()


def read_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} over every TensorBoard event file in `path`, as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
