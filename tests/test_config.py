import dataclasses
import json
import tomllib

import pytest
from conftest import CONFIGS

from transformer_cli.config import (
    TABLE_FIELDS,
    Config,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    check_device_and_precision,
    load_config,
    parse_overrides,
    parse_value,
    with_legacy_values,
)
from transformer_cli.errors import UsageError

CONFIG_FILES = sorted(CONFIGS.glob("*.toml"))


def test_defaults_build_and_equal_an_empty_dict():
    cfg = Config()
    assert set(cfg.to_dict()) == {"model", "data", "train", "pretrain"}
    assert Config.from_dict({}) == cfg
    assert load_config() == cfg


def test_configs_folder_is_not_empty():
    assert CONFIG_FILES, f"no .toml files in {CONFIGS}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_shipped_config_parses_and_applies_its_values(path):
    cfg = load_config(path).to_dict()
    written = tomllib.loads(path.read_text(encoding="utf-8"))
    for section, values in written.items():
        for key, value in values.items():
            assert cfg[section][key] == value, f"{path.name}: {section}.{key}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_shipped_config_sets_only_values_that_differ_from_the_defaults(path):
    """But data.max_length (TABLE_FIELDS): over an `--init-from` encoder without a position table, the default it
    replaces is the encoder's own."""
    defaults = Config().to_dict()
    written = tomllib.loads(path.read_text(encoding="utf-8"))
    same = [f"{section}.{key}" for section, values in written.items() for key, value in values.items()
            if defaults[section][key] == value and (section, key) not in TABLE_FIELDS]
    assert not same, f"{path.name} restates defaults: {same}"


@pytest.mark.parametrize(
    ("d", "expected"),
    [
        ({"model": {"d_model": 100, "n_heads": 8}}, ["model.d_model", "100", "n_heads"]),
        ({"train": {"lr": -0.001}}, ["train.lr", "-0.001"]),
        ({"model": {"dropout": 1.0}}, ["model.dropout", "1.0"]),
        ({"model": {"dropout": -0.1}}, ["model.dropout", "-0.1"]),
        ({"model": {"d_modle": 64}}, ["model.d_modle"]),
        ({"optim": {"lr": 0.1}}, ["optim"]),
        ({"model": {"n_layers": "3"}}, ["model.n_layers", "'3'"]),
        ({"model": {"n_layers": True}}, ["model.n_layers", "True"]),
        ({"train": {"epochs": 2.5}}, ["train.epochs", "2.5"]),
        ({"data": {"val_size": 0.0}}, ["data.val_size", "0.0"]),
        ({"data": {"val_size": 1.0}}, ["data.val_size", "1.0"]),
        ({"data": {"val_size": 1.5}}, ["data.val_size", "1.5"]),
        ({"model": {"pooling": "sum"}}, ["model.pooling", "'sum'"]),
        ({"train": {"lr": float("nan")}}, ["train.lr", "nan"]),
        ({"train": {"weight_decay": float("nan")}}, ["train.weight_decay", "nan"]),
        ({"train": {"grad_clip": float("nan")}}, ["train.grad_clip", "nan"]),
        ({"model": {"ngram_buckets": -1}}, ["model.ngram_buckets", "-1"]),
        ({"data": {"val_block": 0}}, ["data.val_block", "0"]),
        ({"model": {"ngram_lr_scale": float("nan")}}, ["model.ngram_lr_scale", "nan"]),
        ({"model": {"ngram_lr_scale": 0}}, ["model.ngram_lr_scale", "0"]),
        ({"model": {"ngram_order": 0}}, ["model.ngram_order", "0"]),
        ({"train": {"checkpoint_every": -1}}, ["train.checkpoint_every", "-1", "0: checkpoint at epoch ends only"]),
        ({"train": {"device": "cuda:x"}}, ["train.device", "'cuda:x'"]),
        ({"train": {"lr": float("inf")}}, ["train.lr", "inf", "must be a finite number"]),
        ({"train": {"weight_decay": float("inf")}}, ["train.weight_decay", "inf", "finite"]),
        ({"model": {"dropout": float("-inf")}}, ["model.dropout", "-inf", "finite"]),
        ({"data": {"vocab_size": 10**12}}, ["data.vocab_size", "1000000000000", "16,777,216"]),
        ({"train": {"seed": -1}}, ["train.seed", "-1", "2**32 - 1"]),
        ({"train": {"seed": 2**64}}, ["train.seed", "2**32 - 1"]),
        ({"train": {"output_dir": ""}}, ["train.output_dir", "must name a folder"]),
        ({"data": {"val_split": "test"}}, ["data.val_split", "'test'", "other than train and test"]),
        ({"data": {"val_split": "train"}}, ["data.val_split", "'train'"]),
        ({"train": {"lr": 10**400}}, ["train.lr", "must be a finite number"]),
        ({"model": {"d_model": 10**30}}, ["model.d_model", "between 1 and 65,536"]),
        ({"model": {"n_layers": 10**6}}, ["model.n_layers", "between 1 and 1,024"]),
        ({"data": {"max_length": 10**8}}, ["data.max_length", "between 2 and 1,048,576"]),
        ({"train": {"num_threads": 100_000}}, ["train.num_threads", "at most 1,024"]),
        ({"model": {"ngram_buckets": 2**63 - 1}}, ["model.ngram_buckets", "up to 16,777,216"]),
        ({"pretrain": {"generator_layers": 10**8}}, ["pretrain.generator_layers", "between 1 and 1,024"]),
        ({"pretrain": {"splits": "train"}}, ["pretrain.splits", "expected a list of str", 'TOML: ["train"]']),
        ({"pretrain": {"splits": "[train]"}}, ["pretrain.splits", "quote a list's strings"]),
        ({"model": {"dropout": ".5"}}, ["model.dropout", "expected float", "numbers as 0.5"]),
        ({"train": {"output_dir": 2024}}, ["train.output_dir", "expected str", 'a string in quotes, "2024"']),
        ({"data": {"max_length": 512, "train_max_length": 1024}}, ["data.train_max_length", "1024", "512"]),
        ({"data": {"train_max_length": 1}}, ["data.train_max_length", "between 2 and data.max_length"]),
        ({"data": {"train_max_length": 256}}, ["data.train_max_length = 256", "learned positions", "rope"]),
    ],
    ids=["heads", "lr", "dropout1", "dropout-neg", "unknown-key", "unknown-section", "str-for-int",
         "bool-for-int", "float-for-int", "val0", "val1", "val1.5", "literal", "lr-nan", "wd-nan", "clip-nan",
         "ngram-buckets-neg", "val-block-0", "ngram-lr-nan", "ngram-lr-0", "ngram-order-0", "checkpoint-neg",
         "device", "lr-inf", "wd-inf", "dropout-neginf", "vocab-huge", "seed-neg", "seed-huge", "output-empty",
         "val-split-test", "val-split-train", "lr-int-overflow", "width-huge", "depth-huge", "length-huge",
         "threads-huge", "ngram-buckets-huge", "generator-huge", "str-for-list", "unquoted-list", "toml-float",
         "int-for-str", "train-length-over", "train-length-1", "train-length-learned"],
)
def test_invalid_values_raise_usage_error_naming_field_and_value(d, expected):
    with pytest.raises(UsageError) as e:
        Config.from_dict(d)
    for part in expected:
        assert part in str(e.value)


def test_a_shorter_training_length_is_allowed_where_positions_hold_no_table():
    for pos_emb in ("rope", "sinusoidal"):
        cfg = Config.from_dict({"model": {"pos_emb": pos_emb}, "data": {"max_length": 1024, "train_max_length": 512}})
        assert (cfg.data.max_length, cfg.data.train_max_length) == (1024, 512)
    assert Config.from_dict({"data": {"max_length": 512, "train_max_length": 512}}).data.train_max_length == 512


@pytest.mark.parametrize(("objective", "field", "value", "for_"), [
    ("mlm", "generator_layers", 2, "electra"), ("skipgram", "detection_weight", 10.0, "electra"),
    ("skipgram", "mask_prob", 0.3, "mlm or electra"), ("skipgram", "window", 128, "mlm or electra"),
])
def test_a_setting_of_another_pretraining_objective_is_refused_not_ignored(objective, field, value, for_):
    with pytest.raises(UsageError, match=rf"pretrain.{field} = {value!r}: is for pretrain.objective = {for_}, "
                                         rf"not '{objective}'"):
        Config.from_dict({"pretrain": {"objective": objective, field: value}})
    Config.from_dict({"pretrain": {"objective": for_.split()[0], field: value}})  # its own objective takes it


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "cuda0", "CPU", "", "cpu "])
def test_unknown_device_names_are_usage_errors(name):
    with pytest.raises(UsageError, match="unknown device; use auto, cpu, cuda, cuda:N or mps"):
        check_device_and_precision(name, None)
    with pytest.raises(UsageError, match="train.device"):
        TrainConfig(device=name)


def test_unknown_precision_names_are_usage_errors():
    with pytest.raises(UsageError, match="--precision fp8: unknown precision; use auto, fp32, bf16 or fp16"):
        check_device_and_precision("cpu", "fp8")
    with pytest.raises(UsageError, match="train.precision"):
        TrainConfig(precision="fp8")


@pytest.mark.parametrize(("device", "precision"), [("auto", None), ("cuda:1", "bf16"), ("mps", "fp16"), ("cpu", "fp32")])
def test_device_and_precision_names_that_a_run_accepts_pass(device, precision):
    check_device_and_precision(device, precision)
    TrainConfig(device=device, precision=precision or "auto")


def test_section_must_be_a_table():
    with pytest.raises(UsageError, match="model"):
        Config.from_dict({"model": 3})


@pytest.mark.parametrize("top_level", ["epochs = 3", 'source = "x"'])
def test_a_key_outside_any_section_of_a_config_file_is_a_usage_error(tmp_path, top_level):
    path = tmp_path / "c.toml"
    path.write_text(f"{top_level}\n[model]\nd_model = 16\nn_heads = 2\n")
    with pytest.raises(UsageError, match=top_level.split()[0]):
        load_config(path)


@pytest.mark.parametrize(("section", "field", "value"),
                         [("train", "lr", 1), ("train", "weight_decay", 0), ("model", "dropout", 0)])
def test_int_for_a_float_field_becomes_float(section, field, value):
    got = getattr(getattr(Config.from_dict({section: {field: value}}), section), field)
    assert type(got) is float and got == value


def test_int_override_for_a_float_field_becomes_float():
    lr = load_config(None, parse_overrides(["train.lr=1"])).train.lr
    assert type(lr) is float and lr == 1.0


@pytest.mark.parametrize(
    ("item", "key", "value"),
    [
        ("train.lr=3e-4", "train.lr", 3e-4),
        ("data.source=../x", "data.source", "../x"),
        ('data.source="a b"', "data.source", "a b"),
        ("model.n_layers=4", "model.n_layers", 4),
        ("train.compile=true", "train.compile", True),
        (" train.seed = 7 ", "train.seed", 7),
    ],
)
def test_parse_overrides_uses_toml_values_and_bare_strings(item, key, value):
    parsed = parse_overrides([item])
    assert parsed == {key: value}
    assert type(parsed[key]) is type(value)


def test_parse_value_keeps_unparseable_text():
    assert parse_value("stanfordnlp/imdb") == "stanfordnlp/imdb"


@pytest.mark.parametrize("item", ["train.lr", "=3", "", "train.lr 3"])
def test_bad_override_forms_raise(item):
    with pytest.raises(UsageError):
        parse_overrides([item])


@pytest.mark.parametrize("key", ["lr", "train.lr.x", "optim.lr", ".lr"])
def test_bad_override_keys_raise(key):
    with pytest.raises(UsageError) as e:
        apply_overrides({}, {key: 1})
    assert key in str(e.value)


def test_overrides_reach_the_config_and_leave_the_input_alone():
    d = {"train": {"lr": 0.1}}
    cfg = load_config(None, {"train.lr": 0.2, "model.n_layers": 5})
    assert (cfg.train.lr, cfg.model.n_layers) == (0.2, 5)
    apply_overrides(d, {"train.lr": 0.3})
    assert d == {"train": {"lr": 0.1}}


def test_override_of_an_unknown_field_raises():
    with pytest.raises(UsageError, match="model.n_layer"):
        load_config(None, parse_overrides(["model.n_layer=2"]))


def test_replace_changes_only_the_given_fields_and_validates():
    cfg = Config()
    assert cfg.train.lr != 5e-4 and cfg.model.n_layers != 1  # both differ from the defaults
    new = cfg.replace(train={"lr": 5e-4}, model={"n_layers": 1})
    assert (new.train.lr, new.model.n_layers) == (5e-4, 1)
    assert cfg.train.lr == Config().train.lr  # the original is untouched
    expected = cfg.to_dict()
    expected["train"]["lr"], expected["model"]["n_layers"] = 5e-4, 1
    assert new.to_dict() == expected
    with pytest.raises(UsageError, match="train.lr"):
        cfg.replace(train={"lr": -1.0})
    with pytest.raises(UsageError, match="train.nope"):
        cfg.replace(train={"nope": 1})


@pytest.mark.parametrize("path", [None, *CONFIG_FILES], ids=lambda p: "defaults" if p is None else p.name)
def test_json_round_trip_is_identity(path, tmp_path):
    cfg = load_config(path, {"train.max_steps": 7, "data.cache_dir": str(tmp_path / "cache")})
    again = Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()


def test_sections_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().d_model = 3  # type: ignore[misc]


@pytest.mark.parametrize("content", [None, "[model\nd_model = ", "DIR"])
def test_unreadable_config_files_raise_usage_error(tmp_path, content):
    path = tmp_path / "c.toml"
    if content == "DIR":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match="c.toml"):
        load_config(path)


def test_saved_configs_get_the_values_of_fields_added_after_them():
    # Saved before the n-gram path existed: it stays off.
    assert with_legacy_values({"model": {"d_model": 64}})["model"]["ngram_buckets"] == 0
    # Saved with the first n-gram path (bigrams, every occurrence counted, one loss): rebuilt as it was trained.
    first = with_legacy_values({"model": {"ngram_buckets": 1 << 20}, "data": {}})
    assert first["model"] == {"ngram_buckets": 1 << 20, "ngram_order": 2, "ngram_binary": False, "ngram_own_loss": False,
                              "ff": "gelu"}  # and saved before gated feed-forward layers: the plain one
    assert first["data"] == {"val_block": 1, "val_split": ""}  # validated on a part held out of train
    # A field that was saved keeps its value.
    assert with_legacy_values({"model": {"ngram_order": 3, "ngram_binary": True}})["model"]["ngram_order"] == 3


def test_local_data_paths_are_recorded_absolute_so_a_run_finds_them_from_anywhere(tmp_path, monkeypatch):
    (tmp_path / "reviews").mkdir()  # a bare folder name, which read from elsewhere looks like a Hub id
    (tmp_path / "a.csv").write_text("text,label\nx,0\n")
    (tmp_path / "pseudo.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides={"data.source": "reviews", "data.pseudo_labels": "pseudo.jsonl"})
    assert cfg.data.source == str(tmp_path.resolve() / "reviews")
    assert cfg.data.pseudo_labels == str(tmp_path.resolve() / "pseudo.jsonl")
    named = load_config(overrides={"data.source": "train=a.csv,test=missing.csv"}).data.source
    assert named == f"train={tmp_path.resolve() / 'a.csv'},test=missing.csv"  # a missing file is left for the error
    assert load_config(overrides={"data.source": "stanfordnlp/imdb"}).data.source == "stanfordnlp/imdb"  # a Hub id
    assert load_config().data.source == "stanfordnlp/imdb"


def test_a_tilde_in_the_output_folder_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config(overrides={"train.output_dir": "~/runs/x"}).train.output_dir == str(tmp_path / "runs" / "x")
    assert load_config(overrides={"train.output_dir": "runs/~x"}).train.output_dir == "runs/~x"


@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_an_empty_output_dir_option_is_refused_not_taken_for_the_current_folder(tmp_path, monkeypatch, command):
    from test_cli import assert_fails_cleanly, tfm

    monkeypatch.chdir(tmp_path)
    result = tfm(command, "--config", CONFIGS / "tiny.toml", "--data", tmp_path / "none.csv", "-o", "")
    assert_fails_cleanly(result, 2, "train.output_dir", "must name a folder")
    assert list(tmp_path.iterdir()) == []
