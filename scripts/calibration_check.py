"""Temperature scaling of a trained model, measured: fit T on the run's validation split, then the ECE
and NLL on another split (default test) before and after, from one forward pass over each split.

    python scripts/calibration_check.py MODEL_DIR [--split test] [--save]

--save stores the fitted calibration in MODEL_DIR/config.json, as `tfm train` does with
train.calibrate (for a model trained without it). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from transformer_cli.calibration import calibrate, expected_calibration_error, save_calibration, softmax
from transformer_cli.data import prepare_eval_data
from transformer_cli.errors import TfmError
from transformer_cli.evaluate import all_logits, load_for_inference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--split", default="test")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--save", action="store_true", help="store the calibration in MODEL_DIR/config.json")
    args = ap.parse_args()

    rt, model, cfg, tokenizer, labels, _ = load_for_inference(args.model_dir, args.device, None)
    t0 = time.perf_counter()

    def logits_of(split: str):
        enc = prepare_eval_data(cfg.data, tokenizer, split, None, cfg.train.seed, labels)  # ids of the model's classes
        return all_logits(model, enc, rt, cfg.train.eval_batch_size, len(labels)), enc.labels

    val_logits, val_labels = logits_of("validation")
    cal = calibrate(val_logits, val_labels)
    logits, y = logits_of(args.split)
    if args.save:  # only once every split was read: a failed run changes nothing
        save_calibration(args.model_dir, cal)
    t = cal["temperature"]
    out = {
        "model_dir": args.model_dir, "split": args.split, "num_examples": len(y), "temperature": t,
        "validation": cal,
        f"{args.split}_ece_before": expected_calibration_error(softmax(logits), y),
        f"{args.split}_ece_after": expected_calibration_error(softmax(logits, t), y),
        f"{args.split}_nll_before": F.cross_entropy(logits.double(), torch.as_tensor(y)).item(),
        f"{args.split}_nll_after": F.cross_entropy(logits.double() / t, torch.as_tensor(y)).item(),
        f"{args.split}_accuracy": float((logits.argmax(-1).numpy() == y).mean()),
        "seconds": time.perf_counter() - t0,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    try:
        main()
    except TfmError as e:
        print(f"calibration_check: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
