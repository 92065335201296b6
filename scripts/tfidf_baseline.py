"""The classical baseline on tfm's own split: TF-IDF (word 1-2 grams, sublinear tf) + logistic regression.

Fits on the same 90% of the train split that `tfm train` trains on (same stratified split, same
seed), and prints accuracy on the held-out validation part and on the test split, so that a
transformer's validation figure can be read against the baseline's.

Needs scikit-learn, which tfm itself does not: `pip install scikit-learn`.

    python scripts/tfidf_baseline.py --data ../shared/data/imdb
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from transformer_cli.errors import TfmError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="stanfordnlp/imdb")
    ap.add_argument("--seed", type=int, default=1337, help="the split seed (tfm train --seed)")
    ap.add_argument("--val-block", type=int, default=1, help="hold out runs of this many reviews (tfm's data.val_block)")
    ap.add_argument("--C", type=float, default=10.0, help="inverse regularisation strength")
    args = ap.parse_args()

    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        raise TfmError("this baseline needs scikit-learn, which tfm does not: pip install scikit-learn") from None

    from transformer_cli.config import DataConfig
    from transformer_cli.data import load_splits, stratified_split

    cfg = DataConfig(source=args.data, val_block=args.val_block)
    raw, _ = load_splits(cfg, ("train", "test"))
    train_idx, val_idx = stratified_split(raw["train"].labels, cfg.val_size, args.seed, cfg.val_block)
    train, val, test = raw["train"].subset(train_idx), raw["train"].subset(val_idx), raw["test"]

    t0 = time.perf_counter()
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2)
    model = LogisticRegression(C=args.C, max_iter=1000).fit(vectorizer.fit_transform(train.texts), train.labels)
    fit_sec = time.perf_counter() - t0

    def accuracy(split) -> float:
        return float(np.mean(model.predict(vectorizer.transform(split.texts)) == split.labels))

    print(f"TF-IDF (1-2 grams) + logistic regression, C={args.C}, fitted on {len(train)} reviews in {fit_sec:.0f} s")
    print(f"validation ({len(val)}): {accuracy(val):.4f}   test ({len(test)}): {accuracy(test):.4f}")


if __name__ == "__main__":
    try:
        main()
    except TfmError as e:
        print(f"tfidf_baseline: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
