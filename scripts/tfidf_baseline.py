"""The classical baseline on tfm's own split: TF-IDF (word 1-2 grams, sublinear tf) + logistic regression.

Fits on the reviews `tfm train` trains on and prints accuracy on those it validates on (the
dataset's validation split if it has one, else the same stratified part held out of train, same
seed) and on the test split, so that a transformer's validation figure can be read against the
baseline's.

Needs scikit-learn, which tfm itself does not: `pip install scikit-learn`.

    python scripts/tfidf_baseline.py --data path/to/imdb
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from transformer_cli.errors import TfmError


def splits(data: str, seed: int) -> tuple:
    """(train, validation, test) as `tfm train --seed SEED` would have them."""
    from transformer_cli.config import DataConfig
    from transformer_cli.data import load_splits, train_val_splits

    cfg = DataConfig(source=data)
    train, val, label_names, _ = train_val_splits(cfg, seed, ("test",))
    return train, val, load_splits(cfg, ("test",), label_names=label_names)[0]["test"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="stanfordnlp/imdb")
    ap.add_argument("--seed", type=int, default=1337, help="the split seed (tfm train --seed)")
    ap.add_argument("--C", type=float, default=10.0, help="inverse regularisation strength")
    args = ap.parse_args()

    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
    except ImportError as e:  # (e says which module: scikit-learn itself, or one it needs)
        need = "this baseline needs scikit-learn, which tfm does not (pip install scikit-learn)"
        raise TfmError(f"{need}: {e}") from None

    train, val, test = splits(args.data, args.seed)

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
