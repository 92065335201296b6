import json
import pickle
from pathlib import Path

import pytest
import torch
from conftest import edit_config

from transformer_cli import checkpoint as ckpt
from transformer_cli.config import ModelConfig
from transformer_cli.errors import TfmError
from transformer_cli.evaluate import load_model_dir
from transformer_cli.model import CTransformer


def tiny_model(**kw) -> CTransformer:
    cfg = ModelConfig(**{"d_model": 16, "n_heads": 2, "n_layers": 1, "ff_mult": 2, **kw})
    return CTransformer(cfg, vocab_size=40, max_length=16)


# --------------------------------------------------------------------------- weights


@pytest.fixture
def weights_file(tmp_path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    ckpt.atomic_write_bytes(path, ckpt.state_bytes(tiny_model()))
    return path


def test_load_weights_round_trip(weights_file):
    from safetensors.torch import load_file

    model = tiny_model()
    ckpt.load_weights(model, weights_file)
    saved = load_file(weights_file)
    state = model.state_dict()
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in saved)


@pytest.mark.parametrize(("kw", "match"), [({"d_model": 32}, "shape"), ({"n_layers": 2}, "missing")])
def test_load_weights_refuses_mismatches(weights_file, kw, match):
    model = tiny_model(**kw)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TfmError, match=match):
        ckpt.load_weights(model, weights_file)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # left untouched


def test_load_weights_refuses_damaged_files(weights_file):
    weights_file.write_bytes(weights_file.read_bytes()[:100])
    with pytest.raises(TfmError, match="damaged"):
        ckpt.load_weights(tiny_model(), weights_file)


# --------------------------------------------------------------------------- the model directory


def test_load_model_dir(model_dir):
    model, cfg, tokenizer, labels, _ = load_model_dir(model_dir)
    assert not model.training
    assert labels == ["neg", "pos"]
    assert model.encoder.tok_emb.num_embeddings == tokenizer.get_vocab_size()
    assert cfg.model.d_model == model.encoder.tok_emb.embedding_dim


def test_load_model_dir_reads_the_calibration_temperature(model_dir):
    edit_config(model_dir, calibration={"temperature": 1.5})
    assert load_model_dir(model_dir).temperature == 1.5
    edit_config(model_dir, calibration={"temperature": -1})  # refused when loaded, before any work
    with pytest.raises(TfmError, match="config.json' has an invalid calibration temperature -1"):
        load_model_dir(model_dir)


def test_a_model_saved_with_a_removed_setting_loads_only_where_it_made_no_difference(model_dir):
    """A model directory of an older tfm holds fields this version no longer has: at the value that behaves
    as this version does (the n-gram path off) they are dropped; at another the model is refused, naming it."""
    meta = json.loads((model_dir / ckpt.CONFIG_FILE).read_text())
    meta["model"].update(ngram_buckets=0, ngram_order=2, ngram_lr_scale=1.0)
    (model_dir / ckpt.CONFIG_FILE).write_text(json.dumps(meta))
    assert load_model_dir(model_dir).cfg.model == ModelConfig(**{k: v for k, v in meta["model"].items()
                                                                 if not k.startswith("ngram_")})
    meta["model"]["ngram_buckets"] = 64
    (model_dir / ckpt.CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(TfmError, match=r"was made with model.ngram_buckets = 64, which this version of tfm no longer "
                                       r"has") as e:
        load_model_dir(model_dir)
    assert "\n" not in str(e.value)


def test_load_model_dir_refuses_a_missing_directory(tmp_path):
    with pytest.raises(TfmError, match="does not exist"):
        load_model_dir(tmp_path / "nothing")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(TfmError, match="'.*afile' is a file, not a directory"):
        load_model_dir(tmp_path / "afile")


@pytest.mark.parametrize("edit", [
    lambda meta: meta["model"].update(d_model="abc"),
    lambda meta: meta["model"].update(nope=1),
    lambda meta: meta.update(labels="xy"),
    lambda meta: meta.update(labels=["pos", "pos"]),
    lambda meta: meta.update(labels=["only"]),
], ids=["ill-typed", "unknown-key", "labels-string", "labels-repeated", "one-label"])
def test_load_model_dir_names_config_json_for_a_bad_value(model_dir, edit):
    meta = json.loads((model_dir / ckpt.CONFIG_FILE).read_text())
    edit(meta)
    (model_dir / ckpt.CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(TfmError, match="config.json' is incomplete or invalid") as e:
        load_model_dir(model_dir)
    assert e.value.exit_code == 1  # a damaged model directory is not a usage error


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_load_model_dir_refuses_weights_that_are_not_finite(model_dir, value):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model_dir / ckpt.MODEL_FILE))
    weights["head.bias"][0] = value
    save_file(weights, str(model_dir / ckpt.MODEL_FILE))
    with pytest.raises(TfmError, match=r"are not finite \(NaN or inf in head.bias\)"):
        load_model_dir(model_dir)


@pytest.mark.parametrize("name", [ckpt.CONFIG_FILE, ckpt.TOKENIZER_FILE, ckpt.MODEL_FILE])
def test_load_model_dir_refuses_a_missing_file(model_dir, name):
    (model_dir / name).unlink()
    with pytest.raises(TfmError, match=f"{name} is missing"):
        load_model_dir(model_dir)


@pytest.mark.parametrize("version", [ckpt.FORMAT_VERSION + 1, None, "1"])
def test_load_model_dir_refuses_another_format_version(model_dir, version):
    edit_config(model_dir, format_version=version)
    with pytest.raises(TfmError, match="format version"):
        load_model_dir(model_dir)


def test_load_model_dir_refuses_a_tokenizer_of_another_vocabulary(model_dir):
    meta = json.loads((model_dir / ckpt.CONFIG_FILE).read_text())
    edit_config(model_dir, vocab_size=meta["vocab_size"] + 1)
    with pytest.raises(TfmError, match="tokens but config.json says"):
        load_model_dir(model_dir)


# --------------------------------------------------------------------------- training checkpoints


class Payload:
    """Unpickling this runs code: it writes the file `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


def write_payload(path: Path, marker: Path, fmt: str) -> None:
    if fmt == "torch.save":
        torch.save({"optimizer": Payload(marker)}, path)
    else:
        path.write_bytes(pickle.dumps({"optimizer": Payload(marker)}, protocol=2))


def checkpoint_folder(root: Path, step: int, complete: bool = True) -> Path:
    path = root / ckpt.CKPT_DIR / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "trainer.json").write_text("{}")
    torch.save({"t": torch.ones(2)}, path / "state.pt")
    if complete:
        (path / ckpt.COMPLETE).write_text(f"{step}\n")
    return path


@pytest.mark.parametrize("fmt", ["torch.save", "raw pickle"])
def test_a_malicious_state_file_is_refused_and_does_not_run(tmp_path, fmt):
    # The payload works: an unrestricted unpickler runs it.
    control = tmp_path / "control-marker"
    write_payload(tmp_path / "control.pt", control, fmt)
    if fmt == "torch.save":
        torch.load(tmp_path / "control.pt", weights_only=False)
    else:
        pickle.loads((tmp_path / "control.pt").read_bytes())
    assert control.read_text() == "pwned"

    marker = tmp_path / "marker"
    folder = checkpoint_folder(tmp_path / "run", 10)
    write_payload(folder / "state.pt", marker, fmt)
    with pytest.raises(TfmError, match="refusing to load"):
        ckpt.load_checkpoint(folder)
    assert not marker.exists()


def save(out: Path, step: int, model, keep: int) -> Path:
    return ckpt.save_checkpoint(out, step, model, {"step": step}, {"t": torch.full((2,), float(step))}, keep)


def test_save_checkpoint_round_trips(tmp_path):
    model = tiny_model()
    path = save(tmp_path, 3, model, keep=2)
    assert path.name == "step-00000003"
    train_state, tensors = ckpt.load_checkpoint(path)
    assert train_state == {"step": 3}
    assert torch.equal(tensors["t"], torch.full((2,), 3.0))
    fresh = tiny_model()
    ckpt.load_weights(fresh, path / ckpt.MODEL_FILE)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_save_checkpoint_keeps_the_newest_complete_ones(tmp_path):
    model = tiny_model()
    incomplete = checkpoint_folder(tmp_path, 99, complete=False)
    stale_tmp = tmp_path / ckpt.CKPT_DIR / ".step-00000002.tmp-1"
    stale_tmp.mkdir()
    for step in range(1, 6):
        save(tmp_path, step, model, keep=2)
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["step-00000004", "step-00000005"]
    assert sorted(p.name for p in (tmp_path / ckpt.CKPT_DIR).iterdir()) == [
        "step-00000004", "step-00000005", incomplete.name]
    with pytest.raises(TfmError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(incomplete)


def test_checkpoint_dirs_of_a_run_without_checkpoints_is_empty(tmp_path):
    assert ckpt.checkpoint_dirs(tmp_path) == []
