"""How much each path of a trained model with an n-gram path (`model.ngram_buckets > 0`) contributes.

The classifier's logits are the transformer's plus the n-gram table's. This script scores a run's
validation split three ways: the whole model, the transformer alone (n-gram table zeroed) and the
n-gram path alone. The validation split is rebuilt exactly as `tfm train` held it out (same seed).

    python scripts/ngram_ablation.py runs/tfm --data ../shared/data/imdb
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn


class NgramsOnly(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model.ngrams(ids, mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a `tfm train` output directory")
    ap.add_argument("--data", help="the dataset it was trained on, if not its config's data.source")
    ap.add_argument("--json", action="store_true", help="print the accuracies as JSON")
    args = ap.parse_args()

    from transformer_cli.data import VALIDATION_SPLIT, prepare_eval_data
    from transformer_cli.errors import TfmError
    from transformer_cli.evaluate import evaluate_model, load_model_dir
    from transformer_cli.runtime import make_runtime

    rt = make_runtime("cpu", "fp32")
    try:
        model, cfg, tokenizer, labels, _ = load_model_dir(args.run, rt.device)
        if model.ngrams is None:
            raise SystemExit(f"error: '{args.run}' was trained without an n-gram path (model.ngram_buckets = 0)")
        if args.data:
            cfg = cfg.replace(data={"source": args.data})
        # what the run validated on, encoded with its own tokenizer (a fine-tuned run's is its encoder's)
        val = prepare_eval_data(cfg.data, tokenizer, VALIDATION_SPLIT, None, cfg.train.seed, labels)
    except TfmError as e:
        raise SystemExit(f"error: {e}") from None

    def accuracy(m: nn.Module) -> float:
        return evaluate_model(m, val, rt, cfg.train.eval_batch_size, len(labels))["accuracy"]

    table = model.ngrams.table.weight
    result = {"model": accuracy(model), "ngrams_only": accuracy(NgramsOnly(model))}
    with torch.no_grad():
        saved = table.clone()
        table.zero_()
        result["transformer_only"] = accuracy(model)
        table.copy_(saved)
    if args.json:
        print(json.dumps(result))
        return
    print(f"validation accuracy of {args.run} ({len(val)} reviews)")
    for name, acc in result.items():
        print(f"  {name:<17} {acc:.2%}")


if __name__ == "__main__":
    main()
