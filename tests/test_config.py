import dataclasses
import json
import tomllib

import pytest
from conftest import CONFIGS

from transformer_cli.config import (
    FORMAT_VERSION,
    REMOVED_FIELDS,
    TABLE_FIELDS,
    Config,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    check_device_and_precision,
    load_config,
    parse_overrides,
    parse_value,
    run_settings,
    saved_config,
)
from transformer_cli.errors import TfmError, UsageError

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
        ({"pretrain": {"mask_prob": 1.0}}, ["pretrain.mask_prob", "1.0", "(0, 1)"]),
        ({"pretrain": {"window": 1}}, ["pretrain.window", "at least 2 tokens"]),
        ({"pretrain": {"splits": ["train", "test"]}}, ["pretrain.splits", "never test"]),
        ({"model": {"ngram_buckets": 0}}, ["unknown config key 'model.ngram_buckets'"]),
        ({"train": {"compile": True}}, ["unknown config key 'train.compile'"]),
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
         "checkpoint-neg", "device", "lr-inf", "wd-inf", "dropout-neginf", "vocab-huge", "seed-neg", "seed-huge",
         "output-empty", "val-split-test", "val-split-train", "lr-int-overflow", "width-huge", "depth-huge",
         "length-huge", "mask-prob-1", "window-1", "pretrain-on-test", "removed-field",
         "removed-setting", "str-for-list", "unquoted-list", "toml-float",
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


@pytest.mark.parametrize(("device", "precision"),
                         [("auto", None), ("cuda:1", "bf16"), ("mps", "fp16"), ("cpu", "fp32")])
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
        ("train.test_at_end=true", "train.test_at_end", True),
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
def test_json_round_trip_is_identity(path):
    cfg = load_config(path, {"train.max_steps": 7, "data.max_eval_samples": 50})
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


def neutral(value):
    """A value at which a removed field behaves as this version does (any value where REMOVED_FIELDS says None)."""
    return "anything" if value is None else value


def test_a_saved_run_loses_its_removed_fields_at_their_neutral_values_silently():
    saved = {"format_version": FORMAT_VERSION, "kind": "classifier", **Config().to_dict()}
    for (section, key), same in REMOVED_FIELDS.items():
        saved[section][key] = neutral(same)
    before = json.loads(json.dumps(saved))
    out = saved_config(saved, "run/config.json")
    assert out == {"format_version": FORMAT_VERSION, "kind": "classifier", **Config().to_dict()}
    assert saved == before  # the input is left alone
    assert Config.from_dict({k: out[k] for k in ("model", "data", "train", "pretrain")}) == Config()


def changed(value):
    """A value other than a removed field's neutral one, of the same type."""
    return not value if isinstance(value, bool) else value + 1 if isinstance(value, (int, float)) else "other"


@pytest.mark.parametrize(("section", "key", "value"), [
    ("model", "ngram_buckets", 4194304), ("data", "tokenizer", "bpe"), ("pretrain", "objective", "electra"),
    *[(section, key, changed(same)) for (section, key), same in REMOVED_FIELDS.items() if same is not None]])
def test_a_saved_run_whose_removed_field_changed_its_behaviour_is_refused_naming_it(section, key, value):
    with pytest.raises(TfmError) as e:
        saved_config({section: {key: value}}, "run/config.json")
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert f"{section}.{key} = {value!r}" in message and "'run/config.json'" in message
    assert not isinstance(e.value, UsageError)  # the run's files are at fault, not the command line


@pytest.mark.parametrize("section, key", [k for k, same in REMOVED_FIELDS.items() if same is None])
def test_a_removed_field_of_speed_or_bookkeeping_is_dropped_whatever_its_value(section, key):
    for value in (True, 7, "kernel", [1, 2]):
        assert saved_config({section: {key: value, "kept": 1}}, "c.json") == {section: {"kept": 1}}


def test_the_settings_of_a_run_folder_are_its_saved_sections_without_removed_fields(tmp_path):
    assert run_settings(tmp_path) is None  # no config.json: not a run
    saved = {"format_version": FORMAT_VERSION, "kind": "classifier", "labels": ["neg", "pos"],
             "model": {"d_model": 32, "attention": "auto", "ngram_buckets": 0}, "train": {"lr": 0.01, "compile": True}}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert run_settings(tmp_path) == {"model": {"d_model": 32}, "train": {"lr": 0.01}}
    saved["model"]["ngram_buckets"] = 4194304
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(TfmError, match=r"config.json' was made with model.ngram_buckets = 4194304"):
        run_settings(tmp_path)


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
