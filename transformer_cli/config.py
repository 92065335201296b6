"""Configuration: dataclasses that validate themselves, loaded from TOML, saved as JSON.

A run is described by one `Config` with three sections (`model`, `data`, `train`). Their defaults
are the default recipe, what `tfm train` runs without --config; each TOML recipe in `configs/`
sets only the fields it changes; `KEY=VALUE` overrides on the command line use dotted keys
(`model.n_layers=4`, `train.lr=3e-4`, `data.source=path/to/imdb`), with TOML value syntax.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from transformer_cli.errors import TfmError, UsageError

MAX_VOCAB = 1 << 24  # a tokenizer larger than this is a typo (the tokenizers library aborts on huge ones)
# Sizes beyond these are typos: they would fail deep in torch (a C++ trace), be killed for memory, or crash.
MAX_WIDTH = 1 << 16  # model.d_model
MAX_DEPTH = 1024  # model.n_layers, model.ff_mult
MAX_LENGTH = 1 << 20  # data.max_length, tokens per text
DEVICE_NAME = re.compile(r"auto|cpu|mps|cuda(:\d+)?")  # what train.device and --device accept
Precision = Literal["auto", "fp32", "bf16", "fp16"]  # what train.precision and --precision accept
SelectMetric = Literal["accuracy", "macro_f1", "loss"]  # validation metrics train.select_metric may name


class _Section:
    """Type checks every field against its annotation, then runs the section's own `validate`."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if not _type_ok(value, hints[f.name]):
                raise UsageError(f"{self._name}.{f.name} = {value!r}: expected {_type_name(hints[f.name])}"
                                 + _toml_hint(value, hints[f.name]))
            if isinstance(value, int) and not isinstance(value, bool) and _wants_float(hints[f.name]):
                try:
                    object.__setattr__(self, f.name, float(value))
                except OverflowError:  # an integer beyond any float
                    self._fail(f.name, "must be a finite number")
            if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name)):
                self._fail(f.name, "must be a finite number")
        self.validate()

    _name = "config"

    def validate(self) -> None:  # pragma: no cover - overridden
        pass

    def _fail(self, name: str, why: str) -> None:
        raise UsageError(f"{self._name}.{name} = {getattr(self, name)!r}: {why}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        for key in d:
            if key not in known:
                raise UsageError(
                    f"unknown config key '{cls._name}.{key}'; valid keys: {', '.join(sorted(known))}"
                )
        return cls(**d)


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    return isinstance(value, tp)


def _wants_float(tp: Any) -> bool:
    if tp is float:
        return True
    args = typing.get_args(tp)
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and float in args and int not in args


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    if tp is type(None):
        return "none"
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _toml_hint(value: Any, tp: Any) -> str:
    """What to write instead, where a value's type suggests how it was mistyped: values are TOML (a
    command-line value that is not TOML arrives as a string)."""
    if isinstance(value, str) and value.strip().startswith("["):
        return ' (values are TOML: quote a list\'s strings, ["a", "b"], and the override for the shell)'
    if isinstance(value, str) and _type_ok([value], tp):
        return f' (a list in TOML: ["{value}"]; quote the override for the shell)'
    if isinstance(value, str) and any(_type_ok(v, tp) for v in (1, 0.5, True)):
        return " (values are TOML: numbers as 0.5 or 1e-3, booleans as true or false)"
    if not isinstance(value, str) and _type_ok("", tp):
        return f' (values are TOML: a string in quotes, "{value}")'
    return ""


@dataclass(frozen=True)
class ModelConfig(_Section):
    _name = "model"
    d_model: int = 64  # embedding / residual width
    n_heads: int = 2
    n_layers: int = 2
    ff_mult: int = 4  # feed-forward hidden = ff_mult * d_model
    ff: Literal["gelu", "geglu"] = "gelu"  # geglu: gated, hidden 2/3 as wide (about the same parameters)
    dropout: float = 0.1  # on embeddings and on what each sub-layer adds to the residual stream
    token_dropout: float = 0.5  # training only: share of tokens hidden from the transformer (like padding)
    pooling: Literal["max", "mean", "first"] = "max"
    norm: Literal["post", "pre"] = "pre"
    pos_emb: Literal["learned", "sinusoidal", "rope"] = "learned"  # rope: rotary, relative positions inside attention

    def validate(self) -> None:
        for name, most in (("d_model", MAX_WIDTH), ("n_heads", MAX_WIDTH), ("n_layers", MAX_DEPTH),
                           ("ff_mult", MAX_DEPTH)):
            if not 1 <= getattr(self, name) <= most:
                self._fail(name, f"must be between 1 and {most:,}")
        if self.d_model % self.n_heads:
            self._fail("d_model", f"must be divisible by model.n_heads = {self.n_heads}")
        if self.pos_emb == "rope" and (self.d_model // self.n_heads) % 2:
            self._fail("pos_emb", f"rope rotates pairs of a head's dimensions: the head size "
                                  f"(d_model / n_heads = {self.d_model // self.n_heads}) must be even")
        for name in ("dropout", "token_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                self._fail(name, "must be in [0, 1)")


@dataclass(frozen=True)
class DataConfig(_Section):
    _name = "data"
    source: str = "stanfordnlp/imdb"  # Hub id, Hub-layout folder, aclImdb folder/tarball, or files
    text_column: str = "text"
    label_column: str = "label"
    val_split: str = "validation"  # the dataset's split to validate on, if it has one; "" = always hold out
    val_size: float = 0.1  # otherwise the fraction of train held out for validation (stratified, seeded)
    vocab_size: int = 30000  # of the WordPiece tokenizer trained on the training texts (lowercased)
    max_length: int = 1024  # tokens per review, including the leading [CLS]
    # Tokens per training review (default: max_length). Shorter trains on cut reviews and still validates, tests and
    # predicts on max_length: attention's cost grows with length, and rotary positions read past where they trained.
    train_max_length: int | None = None
    truncation: Literal["head", "head_tail"] = "head_tail"  # how a review longer than max_length is cut
    # windows: a review is read whole instead, in windows of max_length tokens whose logits are averaged (training
    # reads one window of train_max_length or max_length a review, another each epoch)
    long_text: Literal["truncate", "windows"] = "truncate"
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    pseudo_labels: str | None = None  # a `tfm pseudo-label` file whose reviews join the training part
    pseudo_min_score: float = 0.0  # of those, only the ones labelled with at least this probability

    def validate(self) -> None:
        if not self.source:
            self._fail("source", "must name a dataset")
        if self.val_split in ("train", "test"):
            self._fail("val_split", "must name a split other than train and test (models are chosen on data they "
                       "neither train nor are tested on), or be \"\" to hold out part of train")
        if not 0.0 < self.val_size < 1.0:
            self._fail("val_size", "must be a fraction in (0, 1)")
        if not 100 <= self.vocab_size <= MAX_VOCAB:
            self._fail("vocab_size", f"must be between 100 and {MAX_VOCAB:,}")
        if not 2 <= self.max_length <= MAX_LENGTH:
            self._fail("max_length", f"must be between 2 and {MAX_LENGTH:,}")
        if self.train_max_length is not None and not 2 <= self.train_max_length <= self.max_length:
            self._fail("train_max_length", f"must be between 2 and data.max_length ({self.max_length:,}), or unset")
        for name in ("max_train_samples", "max_eval_samples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                self._fail(name, "must be at least 1 (or unset)")
        if self.pseudo_labels is not None and not self.pseudo_labels:
            self._fail("pseudo_labels", "must name a file written by `tfm pseudo-label` (or be unset)")
        if not 0.0 <= self.pseudo_min_score < 1.0:
            self._fail("pseudo_min_score", "must be a probability in [0, 1)")


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([hms])")


def duration_sec(text: str) -> float:
    """Seconds of a duration such as "90s", "50m", "2h" or "1h30m"; 0 where `text` is none."""
    parts = _DURATION.findall(text)
    if "".join(f"{n}{unit}" for n, unit in parts) != re.sub(r"\s", "", text):
        return 0.0
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[unit] for n, unit in parts)


@dataclass(frozen=True)
class TrainConfig(_Section):
    _name = "train"
    output_dir: str = "runs/tfm"
    epochs: int = 3
    max_steps: int | None = None  # stop after this many optimizer steps, whatever the epochs
    # A wall-clock budget for training ("90s", "50m", "2h", "1h30m"), data preparation aside: the schedule follows its
    # elapsed share, and the run ends within it with its best model (or at max_steps or the epochs, if sooner).
    time_budget: str | None = None
    batch_size: int = 32  # examples per optimizer step, summed over processes and accumulation
    grad_accum_steps: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.1
    layer_lr_decay: float = 1.0  # each encoder layer learns at this multiple of the rate of the one above it
    beta2: float = 0.98  # AdamW's second-moment decay (beta1 is 0.9)
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    warmup_steps: int | None = None  # exactly one of warmup_steps / warmup_ratio is used
    warmup_ratio: float = 0.06
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    ema_decay: float = 0.999  # > 0: validate and save an exponential moving average of the weights; 0: off
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    precision: Precision = "auto"
    log_every: int = 20  # steps between train/* scalars
    eval_every: int | None = 0  # steps between validation passes besides each epoch end; 0/unset: epoch ends only
    select_metric: SelectMetric | None = None  # picks the saved model; unset: accuracy (train), loss (pretrain)
    patience: int = 0  # stop after this many validation passes without a better select_metric; 0: never early
    eval_batch_size: int = 256  # reviews per validation and test batch (pretraining validates in fixed batches)
    test_at_end: bool = False  # evaluate the best model on the test split after training
    checkpoint_every: int | None = 500  # steps between resumable checkpoints besides each epoch end; 0: epoch ends only
    init_from: str | None = None  # a `tfm pretrain` output directory: its encoder and tokenizer start the model
    # For imbalanced classes, each class's weight in the training loss: "balanced" (n / (classes x the class's count)
    # over the training part, as scikit-learn's) or one weight per class, in the labels' order; unset: all equal
    class_weights: Literal["balanced"] | list[float] | None = None

    @property
    def budget_sec(self) -> float | None:
        return None if self.time_budget is None else duration_sec(self.time_budget)

    def validate(self) -> None:
        if self.time_budget is not None and not duration_sec(self.time_budget) > 0:
            self._fail("time_budget", 'must be a positive duration such as "90s", "50m", "2h" or "1h30m"')
        if not self.output_dir.strip():
            self._fail("output_dir", "must name a folder")
        if not 0 <= self.seed < 2**32:
            self._fail("seed", "must be between 0 and 2**32 - 1")
        positive = ("epochs", "batch_size", "grad_accum_steps", "log_every", "eval_batch_size")
        for name in positive:
            if getattr(self, name) < 1:
                self._fail(name, "must be at least 1")
        if self.patience < 0:
            self._fail("patience", "must be at least 0 (0: never stop early)")
        if self.eval_every is not None and self.eval_every < 0:
            self._fail("eval_every", "must be at least 0 (0: validate at epoch ends only)")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            self._fail("checkpoint_every", "must be at least 0 (0: checkpoint at epoch ends only)")
        if self.max_steps is not None and self.max_steps < 1:
            self._fail("max_steps", "must be at least 1 (or unset)")
        if not self.lr > 0:
            self._fail("lr", "must be positive")
        if not self.weight_decay >= 0:
            self._fail("weight_decay", "must be non-negative")
        if not 0.0 < self.layer_lr_decay <= 1.0:
            self._fail("layer_lr_decay", "must be in (0, 1] (1: every layer at train.lr)")
        if not 0.0 <= self.beta2 < 1.0:
            self._fail("beta2", "must be in [0, 1)")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            self._fail("warmup_steps", "must be non-negative")
        if not 0.0 <= self.warmup_ratio < 1.0:
            self._fail("warmup_ratio", "must be in [0, 1)")
        if not self.grad_clip >= 0:
            self._fail("grad_clip", "must be non-negative (0 disables clipping)")
        if not 0.0 <= self.ema_decay < 1.0:
            self._fail("ema_decay", "must be in [0, 1) (0 disables the average)")
        if self.batch_size % self.grad_accum_steps:
            self._fail("batch_size", f"must be divisible by train.grad_accum_steps = {self.grad_accum_steps}")
        if not DEVICE_NAME.fullmatch(self.device):
            self._fail("device", "must be auto, cpu, cuda, cuda:N or mps")
        if isinstance(self.class_weights, list):
            if not all(0 <= w <= sys.float_info.max for w in self.class_weights):
                self._fail("class_weights", "each weight must be a finite number, 0 or more")
            if self.class_weights and not any(self.class_weights):
                self._fail("class_weights", "must give some class a weight above 0")
            object.__setattr__(self, "class_weights", [float(w) for w in self.class_weights])


@dataclass(frozen=True)
class PretrainConfig(_Section):
    """`tfm pretrain`: masked-language-model pretraining of the encoder on unlabelled text."""

    _name = "pretrain"
    mask_prob: float = 0.15  # share of each text's tokens the objective predicts (80% [MASK], 10% random, 10% kept)
    splits: list[str] = field(default_factory=lambda: ["unsupervised", "train"])  # the source's splits read as text
    val_texts: int = 1000  # texts held out to measure the objective on
    window: int = 0  # > 0: each text is cut into near-equal windows of at most this many tokens, each a training
    # example that keeps its positions in the text; 0: whole texts

    def validate(self) -> None:
        if not 0.0 < self.mask_prob < 1.0:
            self._fail("mask_prob", "must be in (0, 1)")
        if not self.splits or "test" in self.splits:
            self._fail("splits", "must name at least one split, and never test (it is kept for the final report)")
        if self.val_texts < 1:
            self._fail("val_texts", "must be at least 1")
        if self.window != 0 and self.window < 2:
            self._fail("window", "must be 0 (whole texts) or at least 2 tokens")


def check_device_and_precision(device: str, precision: str | None) -> None:
    """The names that `--device` and `--precision` of `tfm predict` and `tfm evaluate` accept (None: the
    run's precision), checked against what train.device and train.precision accept."""
    if not DEVICE_NAME.fullmatch(device):
        raise UsageError(f"--device {device}: unknown device; use auto, cpu, cuda, cuda:N or mps")
    if precision is not None and precision not in typing.get_args(Precision):
        raise UsageError(f"--precision {precision}: unknown precision; use auto, fp32, bf16 or fp16")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "pretrain": PretrainConfig}
SECTION_NAMES = ", ".join(SECTIONS)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)

    def __post_init__(self) -> None:
        cut = self.data.train_max_length
        if cut is not None and cut < self.data.max_length and self.model.pos_emb == "learned":
            raise UsageError(f"data.train_max_length = {cut!r} is below data.max_length with learned positions, whose "
                             "rows past it would never train: set model.pos_emb to rope or sinusoidal, or unset it")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        _check_sections(d)
        return cls(**{k: SECTIONS[k].from_dict(d.get(k, {})) for k in SECTIONS})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A copy with some fields of some sections changed, e.g. replace(train={"lr": 1e-3})."""
        d = self.to_dict()
        for section, values in sections.items():
            d[section].update(values)
        return Config.from_dict(d)


# Fields that runs saved by earlier versions may carry, with the value at which this version behaves the same.
REMOVED_FIELDS = {
    ("model", "attention"): None, ("model", "attn_dropout"): 0.0, ("model", "ngram_buckets"): 0,
    ("model", "ngram_order"): None, ("model", "ngram_lr_scale"): None, ("model", "ngram_binary"): None,
    ("model", "ngram_own_loss"): None, ("model", "lazy_embeddings"): False, ("data", "val_block"): 1,
    ("data", "tokenizer"): "wordpiece", ("data", "lowercase"): True, ("data", "cache_dir"): None,
    ("data", "head_fraction"): 0.25, ("train", "num_threads"): None,
    ("train", "beta1"): 0.9, ("train", "min_lr_ratio"): 0.0, ("train", "label_smoothing"): 0.0,
    ("train", "adversarial_eps"): 0.0, ("train", "virtual_adversarial_eps"): 0.0, ("train", "compile"): None,
    ("train", "calibrate"): None, ("train", "keep_checkpoints"): None, ("train", "max_bad_steps"): None,
    ("pretrain", "objective"): "mlm", ("pretrain", "generator_layers"): None,
    ("pretrain", "detection_weight"): None, ("pretrain", "shard_texts"): None,
}  # None: any value (a setting of speed or bookkeeping only)


def saved_config(saved: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """A run's saved config sections without the fields this version no longer has. A field whose saved
    value made the model or its training differ from what this version does is refused, naming it."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in saved.items()}
    for (section, key), same in REMOVED_FIELDS.items():
        values = out.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        value = values.pop(key)
        if same is not None and value != same:
            raise TfmError(f"'{path}' was made with {section}.{key} = {value!r}, which this version of tfm no longer "
                           "has; train it again with this version, or use the version that made it")
    return out


def _check_sections(d: dict[str, Any]) -> None:
    for key, value in d.items():
        if key not in SECTIONS:
            raise UsageError(f"unknown config section '{key}'; valid sections: {SECTION_NAMES}")
        if not isinstance(value, dict):
            raise UsageError(f"config key '{key}' must be a [{key}] table; put fields under [model], [data], "
                             "[train] or [pretrain]")


def parse_value(text: str) -> Any:
    """A command-line value in TOML syntax (`3`, `1e-4`, `true`, `"x"`); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(d: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (`train.lr`) in a nested config dict; returns a new dict."""
    _check_sections(d)
    out = {k: dict(v) for k, v in d.items()}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if not name or "." in name:
            raise UsageError(f"override '{key}' must look like SECTION.FIELD=VALUE, e.g. train.lr=3e-4")
        if section not in SECTIONS:
            raise UsageError(f"unknown config section '{section}' in override '{key}'; valid sections: {SECTION_NAMES}")
        out.setdefault(section, {})[name] = value
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"'{item}' is not an override; write SECTION.FIELD=VALUE, e.g. model.n_layers=4")
        out[key.strip()] = parse_value(value.strip())
    return out


def read_toml(path: str | Path, what: str | None = None) -> dict[str, Any]:
    """A TOML file's tables; `what` names it in errors (default: as a config file)."""
    path = Path(path)
    where = what or f"config file '{path}'"
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        hint = "" if what else "; see configs/ for the shipped recipes"
        raise UsageError(f"{where} does not exist{hint}") from None
    except IsADirectoryError:
        raise UsageError(f"{where} is a directory; pass a .toml file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{where} is not valid TOML: {e}") from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                base: dict[str, Any] | None = None) -> Config:
    """The Config of a TOML recipe (or `base`, a run's saved sections; default: the built-in defaults) with
    dotted-key overrides applied."""
    d = read_toml(path) if path is not None else base or {}
    return Config.from_dict(with_local_paths(with_encoder_of(apply_overrides(d, overrides or {}))))


def run_settings(folder: str | Path) -> dict[str, Any] | None:
    """The config sections a tfm run in `folder` was started with (its config.json); None where there is none."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TfmError(f"'{path}' is unreadable ({e}); pass the run's --config and options again") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        return None
    saved = saved_config(meta, path)
    return {k: saved[k] for k in SECTIONS if isinstance(saved.get(k), dict)}


def with_local_paths(d: dict[str, Any]) -> dict[str, Any]:
    """`data.source` (a folder, a file, or SPLIT=FILE pairs) and `data.pseudo_labels` made absolute where
    they name something on this machine, so that a run's config.json finds its data from any folder:
    read from elsewhere, a relative folder name such as `reviews` would be taken for a Hub id. A `~` in
    `train.output_dir` is the home folder, as in the data's paths (a shell leaves `train.output_dir=~/x` as is)."""
    train = d.get("train")
    if isinstance(train, dict) and isinstance(train.get("output_dir"), str) and train["output_dir"].startswith("~"):
        d = {**d, "train": {**train, "output_dir": str(Path(train["output_dir"]).expanduser())}}
    data = d.get("data")
    if not isinstance(data, dict):
        return d

    def absolute(path: str) -> str:
        p = Path(path).expanduser()
        return str(p.resolve()) if p.exists() else path

    out = {**d, "data": dict(data)}
    source, pseudo = data.get("source"), data.get("pseudo_labels")
    if isinstance(source, str) and source:
        if "=" in source and not Path(source).exists():  # train=a.csv,test=b.csv
            out["data"]["source"] = ",".join(
                f"{split}={absolute(file)}" if sep else part
                for part in source.split(",") for split, sep, file in [part.partition("=")])
        else:
            out["data"]["source"] = absolute(source)
    if isinstance(pseudo, str) and pseudo:
        out["data"]["pseudo_labels"] = absolute(pseudo)
    return out


FORMAT_VERSION = 1  # of a run's config.json
PRETRAINED_KIND = "pretrained encoder"  # config.json's "kind" in the output directory of `tfm pretrain`
# What a pretrained encoder fixes: its sizes, and the tokenizer its embeddings index. data.max_length too where
# the encoder learnt a table of that many positions; rotary or sinusoidal positions hold no table, so the
# classifier may read longer (or shorter) reviews than the encoder's setting, which is then only its default.
ENCODER_FIELDS = {"model": ("d_model", "n_heads", "n_layers", "ff_mult", "ff", "norm", "pos_emb"),
                  "data": ("vocab_size", "max_length")}
TABLE_FIELDS = {("data", "max_length")}  # ENCODER_FIELDS fixed only with model.pos_emb = "learned"
_HELD_OUT = "the classifier's validation data; pretraining holds out pretrain.val_texts texts"
# The settings only `tfm train` reads, with what they are for; `tfm pretrain` refuses any of them that differs from
# its default.
CLASSIFIER_ONLY = {
    "data.label_column": "the labels, which pretraining never reads",
    "data.val_split": _HELD_OUT, "data.val_size": _HELD_OUT,
    "data.max_eval_samples": "the classifier's validation and test sets",
    "data.train_max_length": "the classifier's training reviews; pretraining cuts windows of pretrain.window tokens",
    "data.pseudo_labels": "pseudo-labelled training reviews",
    "data.pseudo_min_score": "pseudo-labelled training reviews",
    "train.test_at_end": "the test split, which pretraining never reads",
    "train.init_from": "a classifier's start from a pretrained encoder; pretraining starts from random weights",
    "train.class_weights": "the classes' weights in the classifier's loss; pretraining predicts tokens",
}
# Classifier-only too, but a recipe file shared by both commands may set them: refused on `tfm pretrain`'s command line.
CLASSIFIER_ONLY_IN_RECIPES = {
    "model.pooling": "the classifier's pooling", "model.token_dropout": "the classifier's word dropout",
    "train.eval_batch_size": "the classifier's validation and test batches; pretraining validates in fixed batches",
}


def check_command_overrides(command: str, overrides: dict[str, Any]) -> None:
    """Refuse a SECTION.FIELD=VALUE override that `command` ('train' or 'pretrain') would parse and never use:
    the [pretrain] section for `tfm train`, CLASSIFIER_ONLY_IN_RECIPES for `tfm pretrain` (CLASSIFIER_ONLY
    settings are refused by pretraining itself, from a file too). A recipe file may hold either."""
    for key in overrides:
        if command == "train" and key.partition(".")[0] == PretrainConfig._name:
            raise UsageError(f"{key} is a setting of `tfm pretrain`; `tfm train` does not use it: drop the override")
        if command == "pretrain" and key in CLASSIFIER_ONLY_IN_RECIPES:
            raise UsageError(f"{key} is for `tfm train` ({CLASSIFIER_ONLY_IN_RECIPES[key]}); `tfm pretrain` does not "
                             "use it: drop the override")


def with_encoder_of(d: dict[str, Any]) -> dict[str, Any]:
    """With `train.init_from`: the encoder's sizes and tokenizer settings taken from that directory's
    config.json, and init_from made absolute. A setting in `d` that contradicts them is refused, but for
    data.max_length over an encoder without a learnt position table (TABLE_FIELDS)."""
    init = d.get("train", {}).get("init_from")
    if not init:
        return d
    if not isinstance(init, str):
        raise UsageError(f"train.init_from = {init!r}: expected a directory path")
    folder = Path(init).expanduser()
    if not folder.is_dir():
        what = "is a file, not a directory" if folder.exists() else "does not exist"
        raise UsageError(f"--init-from '{init}' {what}; pass the output directory of `tfm pretrain`")
    path = folder / "config.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        why = f"--init-from '{init}' has no config.json; pass the output directory of `tfm pretrain`"
        raise TfmError(why) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TfmError(f"'{path}' is unreadable ({e}); pretrain again") from None
    if not isinstance(saved, dict) or saved.get("format_version") != FORMAT_VERSION:
        version = saved.get("format_version") if isinstance(saved, dict) else None
        raise TfmError(f"'{path}' has format version {version!r}; this tfm reads version {FORMAT_VERSION}")
    if saved.get("kind") != PRETRAINED_KIND:  # a classifier's run: its encoder learnt another task's features
        raise UsageError(f"--init-from '{init}' is a classifier trained by `tfm train`, not a pretrained encoder; "
                         "pass the output directory of `tfm pretrain`")
    saved = saved_config(saved, path)
    if not (folder / "tokenizer.json").is_file():  # another tokenizer's ids would index the wrong embedding rows
        raise TfmError(f"--init-from '{init}' has no tokenizer.json, which its encoder's token ids belong to; "
                       "pass the whole output directory of `tfm pretrain`")
    out = {section: dict(values) for section, values in d.items()}
    out["train"]["init_from"] = str(folder.resolve())
    for section, keys in ENCODER_FIELDS.items():
        for key in keys:
            try:
                theirs = saved[section][key]
            except (KeyError, TypeError):
                raise TfmError(f"'{path}' is incomplete: it has no {section}.{key}; pretrain again") from None
            mine = out.setdefault(section, {}).get(key, theirs)
            if (section, key) in TABLE_FIELDS and saved["model"]["pos_emb"] != "learned":
                out[section][key] = mine
                continue
            if mine != theirs:
                raise UsageError(f"{section}.{key} = {mine!r} contradicts the pretrained encoder in '{init}' "
                                 f"({theirs!r}); leave it out: the encoder's sizes and tokenizer come from there")
            out[section][key] = theirs
    return out

