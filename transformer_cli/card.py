"""The model card: README.md in a run's output directory, in the Hugging Face model-card format (YAML front matter
with a model-index, then a page that says what the model is, how it was trained, how well it does, how to use it
and where it falls short). Written at the end of `tfm train` and `tfm pretrain`; `tfm evaluate --split test` adds
the test results."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from transformer_cli.config import PRETRAINED_KIND, Config, saved_config
from transformer_cli.data import HEAD_SHARE, local_paths
from transformer_cli.fileio import atomic_write_text, read_json

CARD_FILE = "README.md"


def write_card(out: str | Path, test: dict | None = None) -> Path:
    """Write OUT/README.md from the run's config.json and metrics.json; `test`: test metrics to report (else those
    metrics.json holds, if any)."""
    out = Path(out)
    meta, metrics = read_json(out / "config.json", "config"), read_json(out / "metrics.json", "metrics")
    saved = saved_config(meta, out / "config.json")
    cfg = Config.from_dict({k: saved[k] for k in ("model", "data", "train", "pretrain") if k in saved})
    test = test or metrics.get("test")
    pretrained = meta.get("kind") == PRETRAINED_KIND
    front = _front_matter(out.name, cfg, metrics, test, pretrained)
    body = _pretrained_body(out, cfg, meta, metrics) if pretrained else _classifier_body(out, cfg, meta, metrics, test)
    path = out / CARD_FILE
    atomic_write_text(path, front + body)
    return path


def reproducing_command(cfg: Config, pretrained: bool) -> str:
    """A command that trains this run again: every setting that differs from the defaults, as an override."""
    default, mine = Config().to_dict(), cfg.to_dict()
    args = ["tfm", "pretrain" if pretrained else "train", "--data", cfg.data.source, "-o", cfg.train.output_dir]
    for section, values in mine.items():
        if section == "pretrain" and not pretrained:
            continue
        for key, value in values.items():
            if value != default[section][key] and key not in ("val_split", "source", "output_dir"):
                args.append(f"{section}.{key}={json.dumps(value)}")
    return shlex.join(args)


def _dataset(cfg: Config) -> str:
    source = cfg.data.source
    return Path(source).name if local_paths(source) else source  # a Hub id as it is, a local path by its name


def _front_matter(name: str, cfg: Config, metrics: dict, test: dict | None, pretrained: bool) -> str:
    import yaml

    dataset = _dataset(cfg)
    card: dict = {"library_name": "transformer-cli", "language": ["en"],
                  "tags": ["transformer-cli", "fill-mask" if pretrained else "text-classification"],
                  "datasets": [dataset], "metrics": ["accuracy"] if pretrained else ["accuracy", "f1"]}
    if not pretrained:
        results = [_result(dataset, "validation", metrics["val"])]
        if test is not None:
            results.append(_result(dataset, "test", test))
        card["model-index"] = [{"name": name, "results": results}]
    return "---\n" + yaml.safe_dump(card, sort_keys=False) + "---\n\n"


def _result(dataset: str, split: str, m: dict) -> dict:
    return {"task": {"type": "text-classification", "name": "Text classification"},
            "dataset": {"name": dataset, "type": dataset, "split": split},
            "metrics": [{"type": "accuracy", "value": round(m["accuracy"], 4), "name": f"{split} accuracy"},
                        {"type": "f1", "value": round(m["macro_f1"], 4), "name": f"{split} macro-F1",
                         "args": {"average": "macro"}}]}


def _model_lines(cfg: Config, meta: dict, metrics: dict) -> list[str]:
    m, d = cfg.model, cfg.data
    return [(f"A transformer encoder written from scratch (`tfm`): {m.n_layers} layers of width {m.d_model}, "
            f"{m.n_heads} heads, feed-forward {m.ff} x{m.ff_mult}, {m.norm}-norm, {m.pos_emb} positions; "
            f"{metrics['num_params']:,} parameters; a WordPiece tokenizer of {meta['vocab_size']:,} tokens, "
            f"trained on the training texts; up to {d.max_length:,} tokens a text.")]


def _classifier_body(out: Path, cfg: Config, meta: dict, metrics: dict, test: dict | None) -> str:
    d, val = cfg.data, metrics["val"]
    held = f"the '{d.val_split}' split" if d.val_split else f"{d.val_size:.0%} of train, held out (stratified)"
    cal = meta.get("calibration", {})
    lines = [f"# {out.name}", "", (f"A text classifier of {len(meta['labels'])} classes "
             f"({', '.join(meta['labels'])}), pooled by {cfg.model.pooling}."), "", *_model_lines(cfg, meta, metrics),
             "", "## Training", "",
             f"Data: `{d.source}`, its train split ({metrics['num_train']:,} examples), validated on {held}."
             + (f" Started from the pretrained encoder `{cfg.train.init_from}`." if cfg.train.init_from else ""), "",
             "```bash", reproducing_command(cfg, pretrained=False), "```", "",
             (f"{metrics['steps']:,} steps of {cfg.train.batch_size} examples at peak learning rate {cfg.train.lr:g} "
             f"({cfg.train.schedule} schedule), weight decay {cfg.train.weight_decay:g}, "
             f"dropout {cfg.model.dropout:g}, word dropout {cfg.model.token_dropout:g}, "
             f"{metrics['precision']} on {metrics['device']}, {metrics['train_time_sec']:.0f} s."),
             "", "## Results", "", "| split | accuracy | macro-F1 | ECE |", "|---|---|---|---|",
             (f"| validation | {val['accuracy']:.4f} | {val['macro_f1']:.4f} | "
              f"{cal.get('ece_after', val.get('ece', float('nan'))):.4f} |")]
    if test is not None:
        ece = test.get("ece", float("nan"))
        lines.append(f"| test | {test['accuracy']:.4f} | {test['macro_f1']:.4f} | {ece:.4f} |")
    temperature = cal.get("temperature", 1.0)
    lines += ["", f"Probabilities are calibrated by temperature {temperature:.3f}, fitted on validation.", "",
              "| class | precision | recall | F1 | support |", "|---|---|---|---|---|"]
    per_class = (test or val)["per_class"]
    lines += [f"| {name} | {c['precision']:.4f} | {c['recall']:.4f} | {c['f1']:.4f} | {c['support']} |"
              for name, c in per_class.items()]
    lines += ["", f"Per class: on {'test' if test else 'validation'}.", "", "## Use", "", "```bash",
              f'tfm predict -c {out.name} "A wonderful film."', f"tfm serve -c {out.name}",
              f"tfm export -c {out.name} -o {out.name}/model.onnx", "```", "", "## Limitations", "",
              f"Trained on `{d.source}`: English movie reviews unless that data says otherwise; text of another kind "
              "or language is read with the same vocabulary and may be classified poorly. "
              + _truncation(cfg), ""]
    return "\n".join(lines)


def _truncation(cfg: Config) -> str:
    d = cfg.data
    if d.truncation == "head":
        return f"A text longer than {d.max_length:,} tokens is read up to that length only."
    return (f"A text longer than {d.max_length:,} tokens is read at its start ({HEAD_SHARE:.0%}) and end only; "
            "its middle is not read.")


def _pretrained_body(out: Path, cfg: Config, meta: dict, metrics: dict) -> str:
    val = metrics["val"]
    lines = [f"# {out.name}", "", "A pretrained encoder (masked-language modelling), to fine-tune a classifier from.",
             "", *_model_lines(cfg, meta, metrics), "", "## Training", "",
             f"Unlabelled text of `{cfg.data.source}` (splits {', '.join(cfg.pretrain.splits)}; "
             f"{meta.get('num_texts', 0):,} texts, {meta.get('test_texts_left_out', 0):,} left out for being test "
             "texts), masking {:.0%} of the tokens.".format(cfg.pretrain.mask_prob), "",
             "```bash", reproducing_command(cfg, pretrained=True), "```", "",
             (f"{metrics['steps']:,} steps, {metrics['train_time_sec']:.0f} s; held-out masked-LM loss "
             f"{val['loss']:.4f}, accuracy {val['accuracy']:.4f}."), "", "## Use", "", "```bash",
             f"tfm train --init-from {out.name} --data path/to/labelled/data", "```", "", "## Limitations", "",
             "An encoder alone: it classifies nothing until fine-tuned.", ""]
    return "\n".join(lines)
